"""Start-up measurement of a step's memory on CUDA, and the KV cache size it leaves room for.

The KV cache takes what ``gpu_memory_utilization`` leaves after what is already in use (the
weights, the CUDA context, other processes) and after the *measured* peak of the largest step
the engine can run: a profiling step of ``max_num_batched_tokens`` tokens in which the largest
batch of rows samples (logits, filtered sampling with top-N logprobs), run through a model
runner over a one-block cache, as vLLM's ``profile_run`` does. The CUDA graphs' private memory
pool is measured the same way, by an eager forward of the largest captured decode batch (and of
the largest with long-tail splits, whose partial outputs take memory too), and the piecewise
graphs' pool with their buffers by an eager run of every piece at the largest token count.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from engine.core.block_pool import cdiv
from engine.config import EngineConfig
from engine.runner.cuda_graphs import CUDAGraphRunner
from engine.runner.kv_cache import KVCache
from engine.runner.model_runner import ModelRunner
from engine.runner.piecewise_graphs import PiecewiseCUDAGraphs
from engine.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSequence, SchedulerOutput
from engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

# What a profiling or warm-up row samples with: every filter and top-N logprobs, the sampler's
# most memory-hungry path.
FILTERED_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=20)


def dummy_step(prefill_lens: list[int], num_decodes: int, context_len: int, block_size: int,
               params: SamplingParams) -> SchedulerOutput:
    """A step of ``num_decodes`` decodes over ``context_len`` tokens each, then one prefill chunk
    (a whole prompt) per entry of ``prefill_lens``; every row samples. All block tables point at
    block 0: run it only before any request owns blocks (its KV writes land in block 0)."""
    scheduled = []
    for i, (length, new) in enumerate([(context_len + 1, 1)] * num_decodes + [(n, n) for n in prefill_lens]):
        seq = Sequence(f"dummy-{i}", 0, [0] * length, length - new, params, arrival=i)
        seq.num_computed_tokens = length - new
        seq.block_table = [0] * cdiv(length, block_size)
        scheduled.append(ScheduledSequence(seq, new))
    return SchedulerOutput(scheduled=scheduled, num_decodes=num_decodes)


def largest_step(max_num_tokens: int, max_num_rows: int, max_model_len: int, block_size: int) -> SchedulerOutput:
    """``max_num_tokens`` tokens in which at least ``min(max_num_rows, max_num_tokens)`` rows
    sample: decodes over one-token contexts, then the remaining tokens as prefill chunks of at
    most ``max_model_len`` tokens."""
    decodes = min(max_num_rows, max_num_tokens) - 1
    prefill = max_num_tokens - decodes
    chunks = [max_model_len] * (prefill // max_model_len) + ([prefill % max_model_len] if prefill % max_model_len else [])
    return dummy_step(chunks, decodes, 1, block_size, FILTERED_SAMPLING)


@dataclass(frozen=True)
class MemoryProfile:
    """Where the GPU's memory goes (bytes).

    Attributes:
        total_bytes: the device's memory.
        budget_bytes: ``total_bytes * gpu_memory_utilization``: this engine's share (as vLLM's,
            per instance: two workers on one GPU at 0.45 each fit).
        others_bytes: in use on the device when the engine started (other processes, e.g. a
            second worker on the same GPU, and this process's CUDA context); not in the budget.
        used_bytes: what this engine took since it started, before the KV cache (weights,
            allocator, libraries' workspaces).
        activation_bytes: peak of the largest step above what it started with.
        cuda_graph_bytes: peak of the largest captured decode batch (the decode graphs' pool)
            plus that of the pieces at the largest token count with their buffers (the piecewise
            graphs' pool), 0 when no graphs are captured.
        kv_cache_bytes: what is left for the KV cache: of the budget, and of the memory the
            device still has free.
    """

    total_bytes: int
    budget_bytes: int
    others_bytes: int
    used_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    kv_cache_bytes: int


def _peak_bytes(device: torch.device, run) -> int:
    """Bytes ``run()`` needs at its peak above what was in use before: the larger of the tensors'
    peak (what it allocated) and the caching allocator's (what it reserved from the device, which
    stays 0 when the allocations fit in segments the allocator already holds)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(torch.cuda.max_memory_reserved(device) - reserved, torch.cuda.max_memory_allocated(device) - allocated)


# Memory a CUDA process uses outside PyTorch's allocator beyond its context (cuBLAS workspaces,
# Triton modules, NIXL registrations): the bound on this engine's use while another process on
# the device grows at the same time.
NON_TORCH_BYTES = 1 << 30


def device_used_bytes(device: torch.device) -> int:
    """Bytes in use on ``device`` by every process (creates this process's CUDA context)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def kv_cache_room(budget_left: int, free: int, peaks: int) -> int:
    """Bytes the KV cache may take: what is left of this engine's budget (``budget_left``) or,
    when the device has less free (other processes hold the rest), the free memory less
    ``NON_TORCH_BYTES`` (the CUDA graphs, streams and NCCL buffers made after this measurement
    need room outside the budget's margin, which is then gone), less the measured activation
    and graph-pool ``peaks`` (<= 0: nothing is left)."""
    return min(budget_left, free - NON_TORCH_BYTES) - peaks


def profile_memory(model: torch.nn.Module, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                   cuda_graph_batch_sizes: list[int], cuda_graph_token_sizes: list[int],
                   others_bytes: int) -> MemoryProfile:
    """Measure the largest step's activation peak (and the graphs' pools) and size the
    KV cache from what is left of ``config.gpu_memory_utilization``; logs the split.

    Args:
        model: the loaded model, on ``device`` (CUDA).
        config: the engine's settings (block size, step limits, ``max_model_len``).
        dtype: of the KV cache.
        cuda_graph_batch_sizes: the decode graphs' ladder to be captured (empty: none).
        cuda_graph_token_sizes: the piecewise graphs' ladder to be captured (empty: none).
        others_bytes: :func:`device_used_bytes` when the engine started, before it loaded
            anything.

    Returns:
        The profile; ``kv_cache_bytes`` may be <= 0 when nothing is left.
    """
    bs, tokens, seqs = config.block_size, config.max_num_batched_tokens, config.max_num_seqs
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    cache = KVCache(model.config, 1, bs, dtype, device)  # a few MiB, left in the "in use" figure

    def run_largest_step() -> None:
        runner = ModelRunner(model, cache, tokens, seqs, max_model_len)
        runner.launch(largest_step(tokens, seqs, max_model_len, bs)).result()

    def run_largest_graph() -> None:
        graphs = CUDAGraphRunner(model, cache, cuda_graph_batch_sizes, cdiv(max_model_len, bs), max_model_len)
        graphs.reset_padding()
        for batch_size, num_splits in graphs.peak_variants():
            graphs.forward(batch_size, num_splits)

    def run_largest_pieces() -> None:
        PiecewiseCUDAGraphs(model, cuda_graph_token_sizes, device).run_pieces(max(cuda_graph_token_sizes))

    activation = _peak_bytes(device, run_largest_step)
    graph = _peak_bytes(device, run_largest_graph) if cuda_graph_batch_sizes else 0
    graph += _peak_bytes(device, run_largest_pieces) if cuda_graph_token_sizes else 0
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization)
    # What the device gained since the engine started is this engine's use, unless a process
    # beside it (a second worker on the GPU, starting at the same time) grew meanwhile: then
    # what this process's allocator holds plus NON_TORCH_BYTES bounds it.
    reserved = torch.cuda.memory_reserved(device)
    used = max(0, min(total - free - others_bytes, reserved + NON_TORCH_BYTES))
    kv_cache_bytes = kv_cache_room(budget - used, free, activation + graph)
    profile = MemoryProfile(total_bytes=total, budget_bytes=budget, others_bytes=others_bytes, used_bytes=used,
                            activation_bytes=activation, cuda_graph_bytes=graph, kv_cache_bytes=kv_cache_bytes)
    gib = 2**30
    logger.info("GPU memory: %.2f GiB budget = %.2f in use (weights, workspaces) + %.2f activation peak + %.2f "
                "CUDA graph pool + %.2f KV cache; %.2f GiB were in use by others at start", budget / gib,
                used / gib, activation / gib, graph / gib, kv_cache_bytes / gib, others_bytes / gib)
    return profile
