"""Decode-only steps replayed from CUDA graphs, one per batch size of a ladder captured at start-up.

A decode step launches about ten kernels per layer; on its own the host cannot launch them as
fast as the GPU runs them (a step of SmolLM2-135M at batch 256 took 17-32 ms eagerly against a
memory floor of about 1.2 ms). A CUDA graph replays the whole forward with one launch. Each
graph reads its inputs from fixed device buffers: a step of ``n`` decodes is padded to the
smallest captured batch size ``>= n``, its padding rows given slot -1 (the cache write skips
them) and sequence length 0 (the paged decode kernel returns 0 for them), so they neither touch
the KV cache nor change a real row (every op is row-wise). The decode kernel is given the fixed
bound ``max_model_len`` instead of the step's longest context, so its grid, and hence the
graph, serves every length. A verification (speculative decoding) runs here as one decode row
per token it verifies. Steps with prefill chunks, fork children, or more rows than the largest
graph do not replay these (:mod:`engine.runner.piecewise_graphs` runs them). The logits
head runs eagerly on the graph's output rows, so only the sampled rows are computed.

A graph fixes the decode kernel's split count too: :func:`~kernels.decode_attention.num_kv_splits`
of its batch size, about one program per SM if every context were as long as the longest. A few
long contexts among short ones then leave the long ones' few programs running while the other
SMs wait (one 3.5k-token context among fifteen of 400 tokens: 65 µs a Llama-3-8B layer on an
H200 against 26 µs split, about 1.2 ms a step). So batch sizes up to ``LONG_TAIL_MAX_BATCH``
whose count is below :func:`~kernels.decode_attention.long_tail_splits` get a second graph with
that count, replayed for a step whose longest context is at least ``LONG_TAIL_IMBALANCE`` times
the mean of its contexts and would leave at least ``LONG_TAIL_MIN_TOKENS`` tokens to each of its
unsplit programs (docs/kernels.md, "Long tails").
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.runner.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.runner.input_buffers import InputBuffers, StepInputs
from engine.runner.kv_cache import KVCache
from engine.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# Measured with Llama-3-8B's heads on an H200 (docs/kernels.md); larger batches unmeasured.
LONG_TAIL_MAX_BATCH = 64
LONG_TAIL_IMBALANCE = 2
LONG_TAIL_MIN_TOKENS = 1024


def is_long_tail(seq_lens: np.ndarray, num_splits: int) -> bool:
    """Whether a decode batch's contexts (``seq_lens``, tokens; padding rows 0 are left out) have
    a long tail: the longest is at least ``LONG_TAIL_IMBALANCE`` times their mean and, cut into
    ``num_splits`` slices, leaves at least ``LONG_TAIL_MIN_TOKENS`` tokens to each program."""
    real = seq_lens[seq_lens > 0]
    if real.size == 0:
        return False
    longest = int(real.max())
    return longest >= LONG_TAIL_MIN_TOKENS * num_splits and longest * real.size >= LONG_TAIL_IMBALANCE * int(real.sum())


def cuda_graph_sizes(config: EngineConfig, device: torch.device) -> list[int]:
    """The batch sizes to capture: none off CUDA or with ``enforce_eager``; else
    ``config.cuda_graph_batch_sizes`` or 1, 2, 4, then every multiple of 8 below
    ``max_num_seqs`` (vLLM's ladder), and ``max_num_seqs``: padding wastes at most 7 rows."""
    if device.type != "cuda" or config.enforce_eager:
        return []
    if config.cuda_graph_batch_sizes is not None:
        return list(config.cuda_graph_batch_sizes)
    top = config.max_num_seqs
    return [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]


def round_up_table(ladder: list[int]) -> list[int]:
    """A lookup table ``t`` with ``t[n]`` the smallest size of ``ladder`` (sorted, positive)
    that is ``>= n``, for ``1 <= n <= ladder[-1]`` (``t[0]`` is unused): how a step is padded
    to the graph that runs it."""
    members, table = set(ladder), [0] * (ladder[-1] + 1)
    for n in range(ladder[-1], 0, -1):
        table[n] = n if n in members else table[n + 1]
    return table


class CUDAGraphRunner:
    """The captured decode graphs of one model over one KV cache.

    Args:
        model: the model (its ``forward`` must not sync with the host on a decode-only step).
        kv_cache: the cache the graphs read and write (captured by address: never reallocate it).
        batch_sizes: the ladder; any order, duplicates ignored.
        max_blocks_per_seq: the block tables' width.
        max_model_len: the decode kernel's fixed bound on context length.
        fixed_kv_splits: one split count for every graph (a batch-invariant engine's, no
            long-tail graphs); ``None``: each batch size's own.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, batch_sizes: list[int],
                 max_blocks_per_seq: int, max_model_len: int, fixed_kv_splits: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        self.max_model_len = max_model_len
        device = kv_cache.tensor.device
        self.buffers = InputBuffers(self.max_batch_size, self.max_batch_size, max_blocks_per_seq,
                                    kv_cache.block_size, device)
        hidden_size = model.config.hidden_size
        dtype = next(model.parameters()).dtype
        self.hidden = torch.empty(self.max_batch_size, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch size, split count)
        from kernels.decode_attention import (  # (Triton is optional; graphs run on CUDA)
            long_tail_splits, num_kv_splits, sm_count)

        num_kv_heads = kv_cache.tensor.shape[1]
        num_sms = sm_count(device)
        self.num_splits = {b: fixed_kv_splits or num_kv_splits(b, num_kv_heads, max_model_len, num_sms)
                           for b in self.batch_sizes}
        long_tail = long_tail_splits(num_kv_heads, num_sms)
        self.long_tail_splits = {b: long_tail for b in self.batch_sizes
                                 if not fixed_kv_splits and b <= LONG_TAIL_MAX_BATCH and long_tail > self.num_splits[b]}
        self._size_for = round_up_table(self.batch_sizes)

    def batch_size_for(self, step: SchedulerOutput) -> int | None:
        """The captured batch size that runs ``step``, or ``None`` when no decode graph can (it
        has prefill chunks, fork children, or too many rows). A verification of ``k`` drafts
        is ``1 + k`` decode rows (:attr:`SchedulerOutput.verifies_as_decodes`)."""
        if step.num_decodes == len(step.scheduled):
            n = len(step.scheduled)
            if any(s.forks for s in step.scheduled):
                return None
        elif step.verifies_as_decodes:
            n = step.num_tokens
        else:
            return None
        return self._size_for[n] if n <= self.max_batch_size else None

    def variants(self) -> list[tuple[int, int]]:
        """``(batch size, split count)`` of every graph :meth:`capture` takes, largest first."""
        pairs = list(self.num_splits.items()) + list(self.long_tail_splits.items())
        return sorted(pairs, reverse=True)

    def peak_variants(self) -> list[tuple[int, int]]:
        """The variants with the largest activations: the largest batch, and the largest one
        with long-tail splits (their partial outputs) if any."""
        top = self.max_batch_size
        pairs = [(top, self.num_splits[top])]
        if self.long_tail_splits:
            largest = max(self.long_tail_splits)
            pairs.append((largest, self.long_tail_splits[largest]))
        return pairs

    def _inputs(self, batch_size: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the device buffers that the graph of ``batch_size`` reads."""
        buf = self.buffers
        metadata = AttentionMetadata(
            slot_mapping=buf.slot_mapping.device[:batch_size],
            block_tables=buf.block_tables.device[:batch_size],
            seq_lens=buf.seq_lens.device[:batch_size],
            query_start_loc=buf.query_start_loc.device[:batch_size + 1],
            num_decodes=batch_size, max_query_len=0,
            max_seq_len=self.max_model_len, max_decode_seq_len=self.max_model_len, num_kv_splits=num_splits,
        )
        return buf.input_ids.device[:batch_size], buf.positions.device[:batch_size], metadata

    @torch.inference_mode()
    def forward(self, batch_size: int, num_splits: int | None = None) -> torch.Tensor:
        """Run the model eagerly on the buffers' first ``batch_size`` rows, as the graph of
        ``(batch_size, num_splits)`` does (default: the batch size's own split count); returns
        the final hidden states ``[batch_size, hidden_size]`` (a view of a buffer the next run
        overwrites)."""
        input_ids, positions, metadata = self._inputs(batch_size, num_splits or self.num_splits[batch_size])
        hidden = self.model(input_ids, positions, self.kv_cache, metadata)
        self.hidden[:batch_size].copy_(hidden)
        return self.hidden[:batch_size]

    def reset_padding(self) -> None:
        """Make every row a padding row (slot -1, sequence length 0): a forward then writes
        nothing to the KV cache."""
        buf = self.buffers
        buf.slot_mapping.device.fill_(-1)
        buf.seq_lens.device.zero_()
        buf.input_ids.device.zero_()
        buf.positions.device.zero_()
        buf.block_tables.device.zero_()
        torch.arange(self.max_batch_size + 1, out=buf.query_start_loc.device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the graphs of :meth:`variants`, largest first so that the smaller ones reuse its
        memory pool. Each is run once eagerly first (compiling its Triton kernels), on padding
        rows only, and replayed once after capture (the first replay uploads the graph)."""
        self.reset_padding()
        pool = torch.cuda.graph_pool_handle()
        for batch_size, num_splits in self.variants():
            self.forward(batch_size, num_splits)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.forward(batch_size, num_splits)
            graph.replay()
            self.graphs[batch_size, num_splits] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batches of 1..%d sequences (%d with long-tail splits)",
                    len(self.graphs), self.max_batch_size, len(self.long_tail_splits))

    def prepare(self, step: SchedulerOutput, batch_size: int) -> StepInputs:
        """Fill the graph's buffers for ``step``, padded to ``batch_size`` rows."""
        return self.buffers.prepare(step, pad_to=batch_size, max_decode_seq_len=self.max_model_len)

    def splits_for(self, batch_size: int) -> int:
        """The split count of the graph that runs the prepared (or loaded) step of
        ``batch_size`` rows: its long-tail graph's when :func:`is_long_tail` holds for the
        buffers' sequence lengths. Every rank of a tensor-parallel engine decides alike."""
        num_splits = self.num_splits[batch_size]
        long_tail = self.long_tail_splits.get(batch_size)
        if long_tail is not None and is_long_tail(self.buffers.seq_lens.host[:batch_size], num_splits):
            return long_tail
        return num_splits

    def replay(self, batch_size: int, num_splits: int) -> torch.Tensor:
        """Run the graph of ``(batch_size, num_splits)`` (:meth:`splits_for`) on the prepared
        buffers; returns the final hidden states ``[batch_size, hidden_size]`` (a view of a
        buffer the next replay overwrites)."""
        self.graphs[batch_size, num_splits].replay()
        return self.hidden[:batch_size]
