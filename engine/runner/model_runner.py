"""Turns a scheduler step into tensors, runs the model, and samples.

Per step the batch's input ids, positions, slot mapping, block tables, sequence lengths and
query offsets are built on the host in persistent buffers (:mod:`engine.runner.input_buffers`) and
copied to the device once each. A decode-only step replays a CUDA graph captured for the
smallest batch size that holds it (:mod:`engine.runner.cuda_graphs`); another step replays graphs of
the pieces between its attentions, captured for the smallest token count that holds it
(:mod:`engine.runner.piecewise_graphs`), and runs its attentions eagerly; a step past both ladders
runs eagerly.
Sampling works on the whole batch at once, and the step's one host sync is a single
device-to-host copy of the sampled tokens with their log-probabilities.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.block_pool import cdiv
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.input_buffers import InputBuffers, StepInputs
from engine.runner.kv_cache import KVCache
from engine.outputs import StepStats
from engine.runner.piecewise_graphs import PiecewiseCUDAGraphs
from engine.runner.sampler import SamplerOutput, SamplingBatch, sample
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


@dataclass
class StepResult:
    """Host-side results of one step, for the sequences that sampled.

    Attributes:
        sequences: the sampled sequences, in batch order (fork children right after their parent).
        token_ids: one new token per sampled sequence.
        logprobs: per token, ``{token_id: logprob}`` of the sampled token plus the top-N.
        stats: what the step ran and how long its host-side preparation took.
    """

    sequences: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    stats: StepStats


class ModelRunner:
    """Runs steps of one model over one KV cache.

    Args:
        model: a ``LlamaForCausalLM``-like module with ``forward(input_ids, positions, kv_cache,
            metadata)`` and ``compute_logits(hidden)``.
        kv_cache: the worker's cache.
        max_num_tokens: tokens per step at most (``max_num_batched_tokens``).
        max_num_seqs: sequences per step, usually (the buffers grow past it for fork children).
        max_model_len: tokens per sequence at most (sizes the block tables).
        seed: seeds the generator of the per-step seed of unseeded requests.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_num_tokens: int, max_num_seqs: int,
                 max_model_len: int, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.tensor.device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.buffers = InputBuffers(max_num_tokens, max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                    self.device)
        self.graphs: CUDAGraphRunner | None = None
        self.pieces: PiecewiseCUDAGraphs | None = None
        self._rng = np.random.default_rng(seed)
        self._sampling: tuple[list[Sequence], SamplingBatch] | None = None
        # Rank 0 of a tensor-parallel engine: sends each step's inputs to the other ranks
        # (engine.parallel.distributed.TPGroup.broadcast_step), set once start-up is over.
        self.broadcast: Callable[[np.ndarray], object] | None = None

    def capture_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """Capture decode-only steps at ``batch_sizes`` (CUDA only); later decode-only steps of
        up to ``max(batch_sizes)`` sequences replay them."""
        self.graphs = CUDAGraphRunner(self.model, self.kv_cache, batch_sizes, self.max_blocks_per_seq,
                                      self.max_model_len)
        self.graphs.capture()

    def capture_piecewise_graphs(self, token_sizes: list[int]) -> None:
        """Capture the pieces between attentions at ``token_sizes`` (CUDA only); later steps of up
        to ``max(token_sizes)`` tokens that no decode graph runs replay them."""
        self.pieces = PiecewiseCUDAGraphs(self.model, token_sizes, self.device)
        self.pieces.capture()

    def release_cuda_graphs(self) -> None:
        """Drop the captured graphs once no step is left to run (later steps run eagerly). A
        tensor-parallel rank does this before it leaves its group: NCCL's communicator teardown
        waits for the graphs that captured its all-reduces to be destroyed."""
        self.graphs = self.pieces = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sampling_batch(self, seqs: list[Sequence], positions: torch.Tensor) -> SamplingBatch:
        """The step's sampling settings; reused (but for positions) while the sampled sequences
        stay the same, as they do from one decode step to the next."""
        if self._sampling is not None and self._sampling[0] == seqs:
            batch = self._sampling[1]
            batch.positions = positions
            return batch
        batch = SamplingBatch.from_sequences(seqs, positions)
        self._sampling = (seqs, batch)
        return batch

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, on_launched: Callable[[], None] | None = None) -> StepResult:
        """Run one step and sample every sequence whose last token was computed.

        A sequence completing its prompt with unforked samples (``n > 1``) also samples one
        token for each fork child from the same logits row. With :attr:`broadcast` set (rank 0
        of a tensor-parallel engine), the step's inputs go to the other ranks before the forward.

        Args:
            step: the scheduled batch.
            on_launched: called once the step's forward and sampling are queued on the device,
                before waiting for the sampled tokens: host work placed there overlaps the
                step's GPU time (on a CPU the step has already run by then).

        Returns:
            The sampled tokens, one per sequence in ``StepResult.sequences``.
        """
        start = time.perf_counter()
        graph_size = self.graphs.batch_size_for(step) if self.graphs is not None else None
        if graph_size is not None:
            inputs = self.graphs.prepare(step, graph_size)
        else:
            inputs = self.buffers.prepare(step)
        if self.broadcast is not None:
            buffers = self.buffers if graph_size is None else self.graphs.buffers
            copies = np.asarray(step.block_copies, dtype=np.int64).reshape(-1)
            self.broadcast(np.concatenate([[graph_size or 0, len(step.block_copies)], copies, buffers.pack()]))
        graph = self._graph(graph_size)
        pieces_size = self._pieces_size(inputs, graph)
        prepared = time.perf_counter()
        logits = self._run(inputs, graph, pieces_size, step.block_copies)
        sampling_start = time.perf_counter()
        seqs = inputs.sampled
        batch = self._sampling_batch(seqs, inputs.sample_positions) if seqs else None
        prepare_s = prepared - start + time.perf_counter() - sampling_start
        out = None if batch is None else sample(
            logits, batch, (int(self._rng.integers(2**31)), int(self._rng.integers(2**31))))
        if on_launched is not None:
            on_launched()
        token_ids, logprobs = ([], []) if out is None else _to_host(out, [s.params.logprobs for s in seqs])
        stats = StepStats(
            num_seqs=len(step.scheduled), num_decodes=step.num_decodes, num_tokens=step.num_tokens,
            cuda_graph_size=graph_size, cuda_graph_splits=None if graph is None else graph[1],
            piecewise_graph_tokens=pieces_size,
            prepare_s=prepare_s, execute_s=time.perf_counter() - start,
            num_kv_slots_used=inputs.num_kv_slots_used, num_kv_slots_allocated=inputs.num_kv_slots_allocated,
        )
        return StepResult(seqs, token_ids, logprobs, stats)

    @torch.inference_mode()
    def follow(self, packed: np.ndarray) -> None:
        """Run the step that rank 0's :meth:`execute` broadcast (``packed``), on another rank of a
        tensor-parallel engine: the same forward and logits (their collectives pair up), no
        sampling."""
        graph_size, num_copies = int(packed[0]), int(packed[1])
        copies = packed[2:2 + 2 * num_copies].reshape(-1, 2).tolist()
        buffers = self.buffers if graph_size == 0 else self.graphs.buffers
        inputs = buffers.load(packed[2 + 2 * num_copies:])
        graph = self._graph(graph_size or None)
        self._run(inputs, graph, self._pieces_size(inputs, graph), copies)

    def _graph(self, graph_size: int | None) -> tuple[int, int] | None:
        """The ``(batch size, split count)`` graph that runs the prepared (or loaded) step of
        ``graph_size`` rows (``None``: eager)."""
        return None if graph_size is None else (graph_size, self.graphs.splits_for(graph_size))

    def _pieces_size(self, inputs: StepInputs, graph: tuple[int, int] | None) -> int | None:
        """The padded token count whose piecewise graphs run a step that ``graph`` does not,
        ``None`` when it runs eagerly."""
        if graph is not None or self.pieces is None:
            return None
        return self.pieces.size_for(inputs.input_ids.shape[0])

    def _run(self, inputs: StepInputs, graph: tuple[int, int] | None, pieces_size: int | None,
             block_copies) -> torch.Tensor | None:
        """Copy blocks (copy-on-write), run the forward (the replay of ``graph``, a ``(batch size,
        split count)`` of :meth:`CUDAGraphRunner.variants`; or the piecewise graphs of
        ``pieces_size`` tokens; or eagerly) and the logits head; returns ``[len(logits_indices),
        vocab]`` float32 logits (``None`` when nothing samples)."""
        for src, dst in block_copies:
            self.kv_cache.tensor[dst].copy_(self.kv_cache.tensor[src])
        num_sampled = inputs.logits_indices.shape[0]
        if graph is not None:
            # Decode-only without forks: row i samples sequence i.
            return self.model.compute_logits(self.graphs.replay(*graph)[:num_sampled])
        if pieces_size is not None:
            hidden = self.pieces.forward(pieces_size, inputs.input_ids, inputs.positions, self.kv_cache,
                                         inputs.metadata)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        if not num_sampled:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))


def _to_host(out: SamplerOutput, num_logprobs: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """Bring the sampled tokens, their log-probabilities and any top-N to the host in one copy."""
    parts = [out.token_ids.to(torch.float64), out.logprobs.to(torch.float64)]  # ids < 2^53: exact
    if out.top_ids is not None:
        parts += [out.top_ids.flatten().to(torch.float64), out.top_logprobs.flatten().to(torch.float64)]
    host = torch.cat(parts).cpu().numpy()
    n = out.token_ids.shape[0]
    token_ids = host[:n].astype(np.int64).tolist()
    chosen = host[n:2 * n].tolist()
    logprobs = [{token: lp} for token, lp in zip(token_ids, chosen)]
    if out.top_ids is not None:
        k = out.top_ids.shape[1]
        top_ids = host[2 * n:2 * n + n * k].astype(np.int64).reshape(n, k).tolist()
        top_lps = host[2 * n + n * k:].reshape(n, k).tolist()
        for entry, ids, lps, count in zip(logprobs, top_ids, top_lps, num_logprobs):
            for tid, lp in zip(ids[:count], lps[:count]):
                entry.setdefault(tid, lp)
    return token_ids, logprobs
