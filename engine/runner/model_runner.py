"""Turns a scheduler step into tensors, runs the model, and samples.

Per step the batch's input ids, positions, slot mapping, block tables, sequence lengths and
query offsets are built on the host in persistent buffers (:mod:`engine.runner.input_buffers`) and
copied to the device once each. A decode-only step replays a CUDA graph captured for the
smallest batch size that holds it (:mod:`engine.runner.cuda_graphs`); another step replays graphs of
the pieces between its attentions, captured for the smallest token count that holds it
(:mod:`engine.runner.piecewise_graphs`), and runs its attentions eagerly; a step past both ladders
runs eagerly.
Sampling works on the whole batch at once. The sampled tokens stay on the device, where the
next step reads the input tokens it has in flight (a decode whose previous token has not reached
the host yet, under async scheduling); their copy to the host, with their log-probabilities,
runs on a side stream behind an event, and :meth:`PendingStep.result` waits for that event
alone, so launching a step never waits for the one before it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.block_pool import cdiv
from engine.layers.quantized import prompt_chunks
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.input_buffers import InputBuffers, StepInputs
from engine.runner.kv_cache import KVCache
from engine.runner.logits_processors import LogitsProcessors
from engine.outputs import StepStats
from engine.runner.piecewise_graphs import PiecewiseCUDAGraphs
from engine.runner.sampler import SamplerOutput, SamplingBatch, sample
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


class PendingStep:
    """A launched step whose results may still be on their way from the device.

    Args:
        sequences: the sequences that sample, in row order.
        host: the results' host tensor (float64: the token ids, their log-probabilities, then
            any top-N ids and log-probabilities), filled once ``ready`` has fired.
        ready: a CUDA event after the step's forward, sampling and copy (``None``: the step
            has run, as on the CPU).
        num_logprobs: the top-N each sequence asked for.
        top_k: the top-N width of ``host`` (0: none).
        stats: the step's stats but for ``execute_s``.
        started: ``time.perf_counter()`` when the step's launch began.
        keep: device tensors the side stream's copy reads, held until the copy is done.
    """

    def __init__(self, sequences: list[Sequence], host: torch.Tensor | None, ready: torch.cuda.Event | None,
                 num_logprobs: list[int], top_k: int, stats: StepStats, started: float,
                 keep: tuple[torch.Tensor, ...] = ()) -> None:
        self.sequences, self.host, self.ready = sequences, host, ready
        self.num_logprobs, self.top_k = num_logprobs, top_k
        self.stats, self.started, self._keep = stats, started, keep

    def result(self) -> StepResult:
        """Wait for the step and return its sampled tokens (blocks only on this step's event)."""
        if self.ready is not None:
            self.ready.synchronize()
        self._keep = ()
        token_ids, logprobs = ([], []) if self.host is None else _unpack(self.host.numpy(), len(self.sequences),
                                                                        self.top_k, self.num_logprobs)
        stats = dataclasses.replace(self.stats, execute_s=time.perf_counter() - self.started)
        return StepResult(self.sequences, token_ids, logprobs, stats)


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


def fixed_kv_splits(kv_cache: KVCache, max_model_len: int) -> int:
    """A batch-invariant engine's one decode-attention split count: one sequence's count at the
    longest context (:func:`kernels.decode_attention.num_kv_splits`), so a lone long stream still
    fills the GPU. A context's slices depend on its own length and this count only, so its
    attention rounds alike in every batch."""
    from kernels.decode_attention import num_kv_splits, sm_count  # (Triton is optional: CUDA only)

    device = kv_cache.tensor.device
    return num_kv_splits(1, kv_cache.tensor.shape[1], max_model_len, sm_count(device))


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
        batch_invariant: CUDA: one decode-attention split count for every step, eager or
            graphed (:func:`fixed_kv_splits`; ``EngineConfig.batch_invariant``, whose linear
            layers the model already has).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, max_num_tokens: int, max_num_seqs: int,
                 max_model_len: int, seed: int = 0, batch_invariant: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.tensor.device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.fixed_kv_splits = fixed_kv_splits(kv_cache, max_model_len) if batch_invariant else None
        self.buffers = InputBuffers(max_num_tokens, max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                    self.device, self.fixed_kv_splits)
        self.graphs: CUDAGraphRunner | None = None
        self.pieces: PiecewiseCUDAGraphs | None = None
        self._rng = np.random.default_rng(seed)
        # The sampled sequences, their batch and the logits processors' version it was built at.
        self._sampling: tuple[list[Sequence], SamplingBatch, int] | None = None
        # Rank 0 (the rank that samples): penalties, bias, bad words, min_tokens and structured
        # output, set by the engine; None: no processing.
        self.logits: LogitsProcessors | None = None
        # Rank 0 of a tensor-parallel engine: sends each step's inputs to the other ranks
        # (engine.parallel.distributed.TPGroup.broadcast_step), set once start-up is over.
        self.broadcast: Callable[[np.ndarray], object] | None = None
        # Under async scheduling with tensor parallelism, every rank: broadcasts rank 0's
        # sampled tokens of a step into the tensor it is given and returns it, so that every
        # rank feeds the next step the same in-flight tokens.
        self.share_sampled: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._sampled: torch.Tensor | None = None  # [num_sampled] int64: the last step's tokens
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def capture_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """Capture decode-only steps at ``batch_sizes`` (CUDA only); later decode-only steps of
        up to ``max(batch_sizes)`` sequences replay them."""
        self.graphs = CUDAGraphRunner(self.model, self.kv_cache, batch_sizes, self.max_blocks_per_seq,
                                      self.max_model_len, self.fixed_kv_splits)
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
        stay the same, as they do from one decode step to the next, and no sequence's logit
        processing state was released meanwhile (its slot may be another's now)."""
        version = self.logits.version if self.logits is not None else 0
        if self._sampling is not None and self._sampling[0] == seqs and self._sampling[2] == version:
            batch = self._sampling[1]
            batch.positions = positions
            return batch
        processing = self.logits.batch(seqs) if self.logits is not None else None
        batch = SamplingBatch.from_sequences(seqs, positions, processing)
        self._sampling = (seqs, batch, version)
        return batch

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> PendingStep:
        """Queue one step on the device and sample every sequence whose last token it computes.

        A sequence completing its prompt with unforked samples (``n > 1``) also samples one
        token for each fork child from the same logits row. A decode whose input token is still
        in flight (sampled by the step launched before this one) reads it from that step's
        sampled tokens on the device. With :attr:`broadcast` set (rank 0 of a tensor-parallel
        engine), the step's inputs go to the other ranks before the forward (and, under async
        scheduling, its sampled tokens after it).

        Args:
            step: the scheduled batch.

        Returns:
            The step in flight; :meth:`PendingStep.result` gives its sampled tokens, one per
            sequence of ``PendingStep.sequences``.
        """
        start = time.perf_counter()
        graph_size, inputs = self._prepare(step)
        if self.broadcast is not None:
            buffers = self.buffers if graph_size is None else self.graphs.buffers
            copies = np.asarray(step.block_copies, dtype=np.int64).reshape(-1)
            self.broadcast(np.concatenate([[graph_size or 0, len(step.block_copies)], copies, buffers.pack()]))
        self._feed_in_flight_tokens(inputs)
        graph = self._graph(graph_size)
        pieces_size = self._pieces_size(inputs, graph)
        prepared = time.perf_counter()
        logits = self._run(inputs, graph, pieces_size, step.block_copies)
        sampling_start = time.perf_counter()
        seqs = inputs.sampled
        batch = self._sampling_batch(seqs, inputs.sample_positions) if seqs else None
        processing = batch.processing if batch is not None else None
        bitmask = self.logits.fill_bitmask(processing) if processing is not None else None
        prepare_s = prepared - start + time.perf_counter() - sampling_start
        out = None if batch is None else sample(
            logits, batch, (int(self._rng.integers(2**31)), int(self._rng.integers(2**31))), bitmask)
        if processing is not None:
            self.logits.record(processing, out.token_ids)
        if out is not None:
            self._sampled = out.token_ids
            if self.share_sampled is not None:
                self.share_sampled(out.token_ids)
            for row, seq in enumerate(seqs):
                seq.sample_row = row
        stats = StepStats(
            num_seqs=len(step.scheduled), num_decodes=step.num_decodes, num_tokens=step.num_tokens,
            cuda_graph_size=graph_size, cuda_graph_splits=None if graph is None else graph[1],
            piecewise_graph_tokens=pieces_size, prepare_s=prepare_s, execute_s=0.0,
            num_kv_slots_used=inputs.num_kv_slots_used, num_kv_slots_allocated=inputs.num_kv_slots_allocated,
        )
        return self._results_to_host(out, seqs, stats, start)

    @torch.inference_mode()
    def greedy(self, step: SchedulerOutput) -> torch.Tensor:
        """Run ``step``'s forward and return each sampling row's argmax token: a draft model's
        step (:mod:`engine.speculative.draft_model`), with no logits processing, sampling state
        or broadcast; a decode-only step replays a decode CUDA graph as in :meth:`launch`.

        Returns:
            ``[num_sampled]`` int64 on the device, in the step's row order (empty when no row
            reaches its last token).
        """
        graph_size, inputs = self._prepare(step)
        graph = self._graph(graph_size)
        logits = self._run(inputs, graph, self._pieces_size(inputs, graph), step.block_copies)
        return torch.empty(0, dtype=torch.int64, device=self.device) if logits is None else logits.argmax(dim=-1)

    def _prepare(self, step: SchedulerOutput) -> tuple[int | None, StepInputs]:
        """The batch size of the decode graph that runs ``step`` (``None``: none does) and its
        inputs, prepared in that graph's buffers or the eager ones."""
        graph_size = self.graphs.batch_size_for(step) if self.graphs is not None else None
        if graph_size is not None:
            return graph_size, self.graphs.prepare(step, graph_size)
        return None, self.buffers.prepare(step)

    def _feed_in_flight_tokens(self, inputs: StepInputs) -> None:
        """Write the input tokens still in flight (``inputs.in_flight``: ``(token row, sampled
        row)``) from the last step's sampled tokens on the device."""
        if inputs.in_flight is not None:
            dst, src = inputs.in_flight
            inputs.input_ids.index_copy_(0, dst, self._sampled.index_select(0, src))

    def _results_to_host(self, out: SamplerOutput | None, seqs: list[Sequence], stats: StepStats,
                         start: float) -> PendingStep:
        """Start the copy of the sampled tokens and their log-probabilities to the host (on a
        side stream after the step's work, on CUDA) and return the step in flight."""
        num_logprobs = [s.params.logprobs for s in seqs]
        if out is None:
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            return PendingStep(seqs, None, ready, num_logprobs, 0, stats, start)
        parts = [out.token_ids.to(torch.float64), out.logprobs.to(torch.float64)]  # ids < 2^53: exact
        if out.top_ids is not None:
            parts += [out.top_ids.flatten().to(torch.float64), out.top_logprobs.flatten().to(torch.float64)]
        packed = torch.cat(parts)
        top_k = 0 if out.top_ids is None else out.top_ids.shape[1]
        if self.device.type != "cuda":
            return PendingStep(seqs, packed, None, num_logprobs, top_k, stats, start)
        # Streams named, not looked up: with no stream or device given, each lookup of the current
        # stream resolves the current device through CUDA's availability checks (tens of µs a step).
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(computed)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        return PendingStep(seqs, host, ready, num_logprobs, top_k, stats, start, keep=(packed,))

    @torch.inference_mode()
    def follow(self, packed: np.ndarray) -> None:
        """Run the step that rank 0's :meth:`launch` broadcast (``packed``), on another rank of a
        tensor-parallel engine: the same forward and logits (their collectives pair up), no
        sampling."""
        graph_size, num_copies = int(packed[0]), int(packed[1])
        copies = packed[2:2 + 2 * num_copies].reshape(-1, 2).tolist()
        buffers = self.buffers if graph_size == 0 else self.graphs.buffers
        inputs = buffers.load(packed[2 + 2 * num_copies:])
        self._feed_in_flight_tokens(inputs)
        graph = self._graph(graph_size or None)
        self._run(inputs, graph, self._pieces_size(inputs, graph), copies)
        if self.share_sampled is not None and inputs.logits_indices.shape[0]:
            self._sampled = self.share_sampled(torch.empty(inputs.logits_indices.shape[0], dtype=torch.int64,
                                                           device=self.device))

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
            with prompt_chunks(inputs.prompt_chunks):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        if not num_sampled:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))


def _unpack(host: np.ndarray, n: int, k: int, num_logprobs: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """The sampled tokens and ``{token_id: logprob}`` of each (the sampled one, then its top-N)
    from the host copy :meth:`ModelRunner._results_to_host` made."""
    token_ids = host[:n].astype(np.int64).tolist()
    chosen = host[n:2 * n].tolist()
    logprobs = [{token: lp} for token, lp in zip(token_ids, chosen)]
    if k:
        top_ids = host[2 * n:2 * n + n * k].astype(np.int64).reshape(n, k).tolist()
        top_lps = host[2 * n + n * k:].reshape(n, k).tolist()
        for entry, ids, lps, count in zip(logprobs, top_ids, top_lps, num_logprobs):
            for tid, lp in zip(ids[:count], lps[:count]):
                entry.setdefault(tid, lp)
    return token_ids, logprobs
