"""Start-up warm-up on CUDA: compile every kernel variant the engine will launch before the first
request, so that the first batch runs as fast as the later ones (before this, the first
``generate`` was 1.5-2.5x slower: Triton compiled inside it).

Triton compiles one binary per combination of constexprs and argument specializations. The
engine's buffers keep strides and alignments fixed (:mod:`engine.runner.input_buffers`), the kernels
do not specialize on what moves (split counts, slices of step buffers), so what remains is: the
prefill chunk sizes' matmuls and kernels, mixed decode + prefill steps, both sampler variants
(greedy only; random with filters and top-N logprobs), every decode-kernel variant an eager step
can hit (:func:`kernels.decode_attention.launch_variants`), and, captured afterwards, the decode
graphs (:mod:`engine.runner.cuda_graphs`) and the pieces of the other steps (:mod:`engine.runner.piecewise_graphs`).
Every dummy step writes only to block 0, before any request
owns it.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.config import EngineConfig
from engine.runner.model_runner import ModelRunner
from engine.outputs import StartupStats
from engine.runner.profiling import FILTERED_SAMPLING, dummy_step, largest_step
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


def prefill_sizes(max_chunk: int) -> list[int]:
    """Chunk sizes to warm up: powers of two below ``max_chunk``, and ``max_chunk``."""
    sizes, size = [], 1
    while size < max_chunk:
        sizes.append(size)
        size *= 2
    return sizes + [max_chunk]


@torch.inference_mode()
def warm_up(runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int) -> None:
    """Run dummy steps and kernel calls through ``runner`` until every eager variant is compiled.

    Args:
        runner: the engine's runner, over the engine's KV cache (no request may own blocks yet).
        max_num_batched_tokens, max_num_seqs: the engine's limits.
    """
    block_size = runner.block_size
    for size in prefill_sizes(min(max_num_batched_tokens, runner.max_model_len)):
        runner.launch(dummy_step([size], 0, 0, block_size, GREEDY)).result()
    runner.launch(largest_step(max_num_batched_tokens, max_num_seqs, runner.max_model_len, block_size)).result()
    sampling = dummy_step([], min(max_num_seqs, max_num_batched_tokens), 1, block_size, FILTERED_SAMPLING)
    runner.launch(sampling).result()

    from kernels.decode_attention import launch_variants, paged_decode_attention

    config, cache = runner.model.config, runner.kv_cache
    k_cache, v_cache = cache.layer(0)
    device, kv_dtype = cache.tensor.device, cache.tensor.dtype
    q_dtype = next(runner.model.parameters()).dtype  # the model's: an fp8 cache's queries are not fp8
    for num_seqs, max_seq_len in launch_variants(config.num_key_value_heads, config.head_dim, kv_dtype, device,
                                                 max_num_seqs, runner.max_model_len):
        q = torch.zeros(num_seqs, config.num_attention_heads, config.head_dim, dtype=q_dtype, device=device)
        block_tables = torch.zeros(num_seqs, runner.max_blocks_per_seq, dtype=torch.int32, device=device)
        seq_lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 1.0, max_seq_len=max_seq_len)


def start_up(runner: ModelRunner, config: EngineConfig, cuda_graph_batch_sizes: list[int],
             cuda_graph_token_sizes: list[int], started: float, load_s: float, profile_s: float) -> StartupStats:
    """On CUDA, warm ``runner`` up and capture its decode graphs (at ``cuda_graph_batch_sizes``)
    and its piecewise graphs (at ``cuda_graph_token_sizes``); return (and log) the start-up
    times, ``started`` being the ``time.perf_counter()`` at which the engine began."""
    warmup_start = time.perf_counter()
    if runner.device.type == "cuda":
        warm_up(runner, config.max_num_batched_tokens, config.max_num_seqs)
    capture_start = time.perf_counter()
    if cuda_graph_batch_sizes:
        runner.capture_cuda_graphs(cuda_graph_batch_sizes)
        with torch.inference_mode():  # the logits head (eager) at every graph size: its GEMM kernels load
            for size in cuda_graph_batch_sizes:
                runner.model.compute_logits(runner.graphs.hidden[:size])
        torch.cuda.synchronize(runner.device)
    if cuda_graph_token_sizes:
        runner.capture_piecewise_graphs(cuda_graph_token_sizes)
    done = time.perf_counter()
    stats = StartupStats(load_s=load_s, profile_s=profile_s, warmup_s=capture_start - warmup_start,
                         cuda_graph_s=done - capture_start, total_s=done - started)
    logger.info("start-up %.1f s: load %.1f, memory profile %.1f, warm-up %.1f, CUDA graphs %.1f", stats.total_s,
                load_s, profile_s, stats.warmup_s, stats.cuda_graph_s)
    return stats
