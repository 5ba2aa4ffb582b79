"""Turns a scheduler step into tensors, runs the model, and samples.

Per step the batch's input ids, positions, slot mapping, block tables, sequence lengths and
query offsets are built once on the host with NumPy and moved to the device in one copy each;
sampling works on the whole batch at once, and the only host sync is reading the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.sampler import SamplerOutput, SamplingBatch, sample
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass
class StepResult:
    """Host-side results of one step, for the sequences that sampled.

    Attributes:
        sequences: the sampled sequences, in batch order (fork children right after their parent).
        token_ids: one new token per sampled sequence.
        logprobs: per token, ``{token_id: logprob}`` of the sampled token plus the top-N.
    """

    sequences: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, float]]


class ModelRunner:
    """Runs steps of one model over one KV cache.

    Args:
        model: a ``LlamaForCausalLM``-like module with ``forward(input_ids, positions, kv_cache,
            metadata)`` and ``compute_logits(hidden)``.
        kv_cache: the worker's cache.
        block_size: tokens per block.
        max_model_len: tokens per sequence at most (bounds the block-table width).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, max_model_len: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.tensor.device
        self.max_blocks_per_seq = -(-max_model_len // block_size)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def build_metadata(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Return ``(input_ids [T] int64, positions [T] int64, metadata)`` for ``step``."""
        bs = self.block_size
        query_lens = np.array([s.num_new_tokens for s in step.scheduled], dtype=np.int64)
        starts = np.array([s.seq.num_computed_tokens for s in step.scheduled], dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        max_blocks = int(-(-seq_lens.max() // bs))
        block_tables = np.zeros((len(query_lens), max_blocks), dtype=np.int32)
        for row, s in enumerate(step.scheduled):
            lo, hi = query_start_loc[row], query_start_loc[row + 1]
            start = starts[row]
            input_ids[lo:hi] = s.seq.token_ids[start : start + s.num_new_tokens]
            positions[lo:hi] = np.arange(start, start + s.num_new_tokens)
            table = s.seq.block_table
            block_tables[row, : len(table)] = table[:max_blocks]
        rows = np.repeat(np.arange(len(query_lens)), query_lens)
        slot_mapping = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs

        nd = step.num_decodes
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            block_tables=self._to_device(block_tables),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            query_start_loc=self._to_device(query_start_loc),
            num_decodes=nd,
            max_query_len=int(query_lens[nd:].max()) if len(query_lens) > nd else 0,
            max_seq_len=int(seq_lens.max()),
            max_decode_seq_len=int(seq_lens[:nd].max()) if nd else 0,
        )
        return self._to_device(input_ids), self._to_device(positions), metadata

    def _sampling_batch(self, seqs: list[Sequence], device: torch.device) -> SamplingBatch:
        params = [s.params for s in seqs]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return SamplingBatch(
            temperature=column([p.temperature for p in params], torch.float32),
            top_p=column([p.top_p for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            min_p=column([p.min_p for p in params], torch.float32),
            generators=[s.generator for s in seqs],
            max_logprobs=max(p.logprobs for p in params),
            all_greedy=all(p.greedy for p in params),
            needs_filter=any(
                not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in params
            ),
        )

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run one step and sample every sequence whose last token was computed.

        A sequence completing its prompt with unforked samples (``n > 1``) also samples one
        token for each fork child from the same logits row, with the child's own generator.

        Returns:
            The sampled tokens, one per sequence in ``StepResult.sequences``.
        """
        for src, dst in step.block_copies:
            self.kv_cache.tensor[dst].copy_(self.kv_cache.tensor[src])
        input_ids, positions, metadata = self.build_metadata(step)
        hidden = self.model(input_ids, positions, self.kv_cache, metadata)

        ends = np.cumsum([s.num_new_tokens for s in step.scheduled]) - 1
        rows, seqs = [], []
        for row, s in enumerate(step.scheduled):
            if s.samples:
                for seq in [s.seq, *s.seq.forks]:
                    rows.append(ends[row])
                    seqs.append(seq)
        if not seqs:
            return StepResult([], [], [])
        index = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        out = sample(logits, self._sampling_batch(seqs, logits.device))
        return StepResult(seqs, *_to_host(out, [s.params.logprobs for s in seqs]))


def _to_host(out: SamplerOutput, num_logprobs: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    token_ids = out.token_ids.tolist()
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    logprobs = []
    for i, token in enumerate(token_ids):
        entry = {token: chosen[i]}
        if top_ids is not None:
            for tid, lp in zip(top_ids[i][: num_logprobs[i]], top_lps[i][: num_logprobs[i]]):
                entry.setdefault(tid, lp)
        logprobs.append(entry)
    return token_ids, logprobs
