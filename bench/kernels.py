"""Benchmark of the Triton paged-attention kernels on a CUDA GPU.

Decode: bf16, 32 query heads, 8 KV heads, head_dim 128, shuffled block tables over a
block-major pool; time and achieved bandwidth (K+V bytes read / time) of
``kernels.paged_decode_attention`` beside ``scaled_dot_product_attention`` on the same data
laid out contiguously (the ceiling) and gather-then-SDPA (a naive paged engine). Prefill:
TFLOP/s of ``kernels.paged_prefill_attention`` for a 512-token chunk over a cached prefix.

Times are medians of CUDA-graph replays, as the decode worker runs them: each graph holds
several calls rotating over input sets that together span far more than L2, so neither launch
overhead nor a warm cache flatters anyone. The paged kernel and contiguous SDPA are timed three
times each, in turn, and their medians compared. ``paged_decode_eager_us_*`` adds the eager time
(``triton.testing.do_bench``, L2 flushed per call), host launch overhead included.

Prints the results as JSON and writes ``<out-dir>/kernels-<gpu>-<date>.json`` (``<out-dir>``:
``--out-dir``, by default ``bench/results/<benchmark>/``). ``--sweep``
times tuning variants instead (tile sizes, warps, stages, split counts), writes
``<out-dir>/sweep.json`` and prints the best ones; ``--sweep focus`` times only the curated
variants of the 16x2048 shape (:data:`FOCUS_VARIANTS`), each beside SDPA, in about a minute.
``--rope-kv`` times a layer's RoPE and KV cache write as one kernel (``rotary_write_kv_cache``)
beside the two it replaces (``rotary_embedding``, then ``write_kv_cache``), in turn in one process:
host time per call (launches queued back to back, no sync inside) and device time (graph replays),
and writes ``<out-dir>/kernels_rope_kv-<gpu>-<date>.json``.
``--long-tail`` times decode batches with and without a long tail (one 3500-token context among
400-token ones) at the two split counts a CUDA graph of their size may have
(``engine/runner/cuda_graphs.py``) and writes ``<out-dir>/kernels_long_tail-<gpu>-<date>.json``.

Usage: python -m bench.kernels [--sweep [focus | NxCTX ...] | --long-tail | --rope-kv] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from bench.common import copy_bandwidth_tbps, gpu_tag, results_dir, write_result
from bench.stats import median
import kernels
import kernels.reference as reference
from kernels.decode_attention import (
    MIN_SPLIT_TOKENS, launch_paged_decode, long_tail_splits, num_kv_splits,
)
from kernels.prefill_attention import launch_paged_prefill
from kernels.rotary import _rotary_write_kv_kernel

Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
DECODE_SHAPES = [(1, 8192), (16, 2048), (64, 2048), (128, 1024), (256, 1024), (64, 8192), (256, 4096)]
BLOCK_SIZES = [8, 32, 64, 128]
PREFILL_CACHED = [0, 2048, 8192]
PREFILL_CHUNK = 512
SWEEP_SHAPES = [(1, 8192), (16, 2048), (64, 2048), (128, 1024)]
# 16x2048 sits on the 95%-of-SDPA line (128 programs on 132 SMs, one per SM): the variants worth
# timing there, (BLOCK_N, warps, stages, splits, K/V eviction policy, head-major block layout).
# `--sweep focus` times only these.
FOCUS_SHAPE = (16, 2048)
FOCUS_VARIANTS = [
    (64, 4, 3, 1, "", False), (64, 4, 3, 1, "evict_first", False), (64, 4, 4, 1, "evict_first", False),
    (32, 4, 4, 1, "", False), (32, 4, 5, 1, "evict_first", False), (32, 2, 4, 1, "evict_first", False),
    (128, 8, 3, 1, "evict_first", False), (64, 8, 3, 1, "", False), (64, 4, 2, 2, "", False),
    (64, 4, 3, 2, "evict_first", False), (64, 4, 3, 1, "", True), (64, 4, 3, 1, "evict_first", True),
    (32, 4, 4, 1, "", True),
]
ROTATE_BYTES = 256 * 2**20  # rotate input sets until they span this much, well past L2
SCALE = HEAD_DIM ** -0.5


def _eager_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph_ms(sets: list, fn, min_calls: int = 16, reps: int = 20) -> float:
    """Median milliseconds of one ``fn(input_set)``, replayed from a CUDA graph of calls that
    rotate over ``sets``."""
    for inputs in sets:  # compile and warm up outside the capture
        fn(inputs)
    torch.cuda.synchronize()
    calls = len(sets) * math.ceil(min_calls / len(sets))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(sets[i % len(sets)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class DecodeInputs:
    """One decode batch: a 2-layer block-major pool, its layer-1 views, shuffled block tables,
    and the same K/V laid out contiguously ``[num_seqs, KV_HEADS, context, HEAD_DIM]``.

    ``head_major`` orders a block's tokens by head (``[..., KV_HEADS, block_size, HEAD_DIM]``, one
    head's tokens contiguous) instead of the engine's token-major order: a layout to compare, seen
    by the kernel through the same strided view."""

    def __init__(self, num_seqs: int, context: int, block_size: int, gen: torch.Generator, head_major: bool = False):
        blocks_per_seq = context // block_size
        num_blocks = num_seqs * blocks_per_seq
        if head_major:
            self.pool = torch.randn(num_blocks, 2, 2, KV_HEADS, block_size, HEAD_DIM, device="cuda", dtype=DTYPE)
            self.k_cache, self.v_cache = self.pool[:, 1, 0].transpose(1, 2), self.pool[:, 1, 1].transpose(1, 2)
        else:
            self.pool = torch.randn(num_blocks, 2, 2, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            self.k_cache, self.v_cache = self.pool[:, 1, 0], self.pool[:, 1, 1]
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_tables = perm.view(num_seqs, blocks_per_seq).cuda()
        self.seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(num_seqs, Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        self.context = context

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather(self.k_cache), self.gather(self.v_cache)

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        ctx = cache[self.block_tables.long()]  # [num_seqs, blocks, block_size, KV_HEADS, HEAD_DIM]
        return ctx.flatten(1, 2).transpose(1, 2).contiguous()

    def kv_bytes(self) -> int:
        return 2 * self.q.shape[0] * self.context * KV_HEADS * HEAD_DIM * self.pool.element_size()


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode with the query heads of each KV head folded into the query-length axis, so K/V
    are read once per KV head (no mask is needed for one query token)."""
    num_seqs = q.shape[0]
    qf = q.view(num_seqs, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    return F.scaled_dot_product_attention(qf, k, v, scale=SCALE).reshape(num_seqs, Q_HEADS, HEAD_DIM)


def _sdpa_decode_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=SCALE, enable_gqa=True).squeeze(2)


def _decode_reference(inp: DecodeInputs) -> torch.Tensor:
    """kernels.reference in chunks of sequences, to bound its float32 working set."""
    chunk = max(1, 32768 // inp.context)
    parts = [
        reference.paged_decode_attention(
            inp.q[s:s + chunk], inp.k_cache, inp.v_cache, inp.block_tables[s:s + chunk],
            inp.seq_lens[s:s + chunk], SCALE, max_seq_len=inp.context,
        )
        for s in range(0, inp.q.shape[0], chunk)
    ]
    return torch.cat(parts)


def _input_sets(num_seqs: int, context: int, block_size: int, gen: torch.Generator,
                head_major: bool = False) -> list[DecodeInputs]:
    first = DecodeInputs(num_seqs, context, block_size, gen, head_major)
    count = min(8, max(1, math.ceil(ROTATE_BYTES / first.pool.numel() / first.pool.element_size())))
    return [first] + [DecodeInputs(num_seqs, context, block_size, gen, head_major) for _ in range(count - 1)]


def _rotating(sets: list, fn):
    cycle = itertools.cycle(sets)
    return lambda: fn(next(cycle))


def _paged(inp: DecodeInputs, **knobs):
    return launch_paged_decode(inp.q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, SCALE,
                               out=inp.out, max_seq_len=inp.context, **knobs)


def bench_decode(metrics: dict, gen: torch.Generator) -> None:
    for num_seqs, context in DECODE_SHAPES:
        tag = f"{num_seqs}x{context}"
        sets = _input_sets(num_seqs, context, 16, gen)
        nbytes = sets[0].kv_bytes()
        metrics[f"paged_decode_eager_us_{tag}"] = _eager_ms(_rotating(sets, _paged)) * 1e3
        metrics[f"paged_decode_max_rel_err_{tag}"] = _rel_err(_paged(sets[0]), _decode_reference(sets[0]))
        gather_ms = _graph_ms(sets, lambda s: _sdpa_decode(s.q, *s.contiguous_kv()))
        contiguous = [(s.q, *s.contiguous_kv()) for s in sets]
        paged_runs, fold_runs = [], []
        for _ in range(3):  # in turn, so that a drift of the clocks cancels in the ratio
            paged_runs.append(_graph_ms(sets, _paged))
            fold_runs.append(_graph_ms(contiguous, lambda c: _sdpa_decode(*c)))
        paged_ms, fold_ms = median(paged_runs), median(fold_runs)
        del sets
        gqa_ms = _graph_ms(contiguous, lambda c: _sdpa_decode_gqa(*c))
        sdpa_ms = min(fold_ms, gqa_ms)
        del contiguous
        torch.cuda.empty_cache()
        metrics[f"paged_decode_us_{tag}"] = paged_ms * 1e3
        metrics[f"paged_decode_tbps_{tag}"] = nbytes / paged_ms / 1e9
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        metrics[f"paged_decode_splits_{tag}"] = num_kv_splits(num_seqs, KV_HEADS, context, sms)
        metrics[f"sdpa_us_{tag}"] = sdpa_ms * 1e3
        metrics[f"sdpa_tbps_{tag}"] = nbytes / sdpa_ms / 1e9
        metrics[f"sdpa_gqa_tbps_{tag}"] = nbytes / gqa_ms / 1e9
        metrics[f"gather_sdpa_tbps_{tag}"] = nbytes / gather_ms / 1e9
        metrics[f"paged_decode_vs_sdpa_{tag}"] = sdpa_ms / paged_ms
        print(f"decode {tag:>9}: paged {metrics[f'paged_decode_tbps_{tag}']:.2f} TB/s, "
              f"sdpa {metrics[f'sdpa_tbps_{tag}']:.2f} (gqa layout {metrics[f'sdpa_gqa_tbps_{tag}']:.2f}), "
              f"gather+sdpa {metrics[f'gather_sdpa_tbps_{tag}']:.2f}", flush=True)
    for block_size in BLOCK_SIZES:
        tag = f"64x2048_bs{block_size}"
        sets = _input_sets(64, 2048, block_size, gen)
        paged_ms = _graph_ms(sets, _paged)
        metrics[f"paged_decode_tbps_{tag}"] = sets[0].kv_bytes() / paged_ms / 1e9
        metrics[f"paged_decode_max_rel_err_{tag}"] = _rel_err(_paged(sets[0]), _decode_reference(sets[0]))
        print(f"decode {tag}: paged {metrics[f'paged_decode_tbps_{tag}']:.2f} TB/s", flush=True)
        del sets


LONG_TAIL_BATCHES = [8, 16, 32, 64]
LONG_TAIL_BOUND = 8192  # the max_model_len a graph's split count is computed at (Llama-3-8B's)
LONG_TAIL_MIXES = {"long_tail": lambda n: [3500] + [400] * (n - 1), "short": lambda n: [400] * n,
                   "uniform2000": lambda n: [2000] * n}


def bench_long_tail(metrics: dict, gen: torch.Generator) -> None:
    """Each batch of :data:`LONG_TAIL_BATCHES` with each context mix of :data:`LONG_TAIL_MIXES`,
    at its graph's own split count (``num_kv_splits`` at :data:`LONG_TAIL_BOUND`) and at
    ``long_tail_splits``: ``long_tail_us_{batch}_{mix}_{own|long_tail}``, and their ratio
    ``long_tail_speedup_{batch}_{mix}`` (own over long-tail time)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    long_tail = long_tail_splits(KV_HEADS, sms)
    for num_seqs in LONG_TAIL_BATCHES:
        own = num_kv_splits(num_seqs, KV_HEADS, LONG_TAIL_BOUND, sms)
        sets = _input_sets(num_seqs, 3504, 16, gen)
        for mix, lengths in LONG_TAIL_MIXES.items():
            for inp in sets:
                inp.seq_lens.copy_(torch.tensor(lengths(num_seqs), dtype=torch.int32))
            tag = f"{num_seqs}_{mix}"
            for label, splits in (("own", own), ("long_tail", long_tail)):
                ms = _graph_ms(sets, lambda s, n=splits: _paged(s, num_splits=n))
                metrics[f"long_tail_us_{tag}_{label}"] = ms * 1e3
            own_us, long_tail_us = metrics[f"long_tail_us_{tag}_own"], metrics[f"long_tail_us_{tag}_long_tail"]
            metrics[f"long_tail_speedup_{tag}"] = own_us / long_tail_us
            print(f"decode {num_seqs} seqs, {mix}: {own} splits {own_us:.1f} µs, "
                  f"{long_tail} splits {long_tail_us:.1f} µs", flush=True)
        del sets
        torch.cuda.empty_cache()


@triton.jit
def _empty_kernel(ptr):
    pass


ROPE_KV_TOKENS = [64, 1088]  # a decode batch; the same with a 1024-token prompt chunk
ROPE_KV_ROUNDS, ROPE_KV_CALLS = 7, 200


def _host_us(fn, calls: int) -> float:
    """Microseconds of host time per ``fn()``, ``calls`` of them queued back to back (the GPU's
    queue is drained before and after, outside the timing)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def bench_rope_kv(metrics: dict, gen: torch.Generator) -> None:
    """A Llama-3-8B layer's RoPE and KV write over ``tokens`` of :data:`ROPE_KV_TOKENS` (bf16,
    fused QKV rows, 16-token blocks at shuffled slots), fused and as two kernels:
    ``rope_kv_{fused|unfused}_{host|device}_us_{tokens}`` and ``rope_kv_host_speedup_{tokens}``
    (unfused over fused host time; the medians of :data:`ROPE_KV_ROUNDS` rounds taken in turn).
    Where a launch's host time goes: ``rope_kv_triton_only_*`` launches the fused kernel through
    Triton without the entry point's checks and allocation, ``rope_kv_empty_*`` a kernel of one
    argument that does nothing (Triton's own floor)."""
    for tokens in ROPE_KV_TOKENS:
        qkv = torch.randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(device="cuda", dtype=DTYPE)
        q, k, v = qkv.view(tokens, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
        angles = torch.rand(tokens, 1, HEAD_DIM // 2, generator=gen).cuda() * 1000
        cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
        num_blocks = triton.cdiv(tokens, 16) + 8
        pool = torch.zeros(num_blocks, 2, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_cache, v_cache = pool[:, 0], pool[:, 1]
        slots = torch.randperm(num_blocks * 16, generator=gen)[:tokens].cuda()

        def fused(_=None):
            kernels.rotary_write_kv_cache(q, k, v, cos, sin, k_cache, v_cache, slots)

        def unfused(_=None):
            _, rot_k = kernels.rotary_embedding(q, k, cos, sin)
            kernels.write_kv_cache(rot_k, v, k_cache, v_cache, slots)

        q_out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
        args = (q, k, v, q_out, cos, sin, k_cache, v_cache, slots,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                q_out.stride(0), q_out.stride(1), cos.stride(0), sin.stride(0), *k_cache.stride(), *v_cache.stride())
        constants = dict(NUM_Q_HEADS=Q_HEADS, NUM_KV_HEADS=KV_HEADS, HALF=HEAD_DIM // 2, PAGE=16, BLOCK_H=32,
                         BLOCK_HALF=HEAD_DIM // 2, SATURATE_AT=0.0, num_warps=4)

        def triton_only(_=None):  # the fused kernel's launch through Triton alone, no wrapper
            _rotary_write_kv_kernel[(tokens,)](*args, **constants)

        def empty(_=None):  # the floor: a one-argument kernel that does nothing
            _empty_kernel[(1,)](slots)

        variants = {"fused": fused, "unfused": unfused, "triton_only": triton_only, "empty": empty}
        host = {name: [] for name in variants}
        for _ in range(ROPE_KV_ROUNDS):
            for name, fn in variants.items():
                host[name].append(_host_us(fn, ROPE_KV_CALLS))
        for name, fn in variants.items():
            metrics[f"rope_kv_{name}_host_us_{tokens}"] = median(host[name])
            metrics[f"rope_kv_{name}_device_us_{tokens}"] = _graph_ms([None], fn) * 1e3
        metrics[f"rope_kv_host_speedup_{tokens}"] = (metrics[f"rope_kv_unfused_host_us_{tokens}"]
                                                     / metrics[f"rope_kv_fused_host_us_{tokens}"])
        us = {key: metrics[f"rope_kv_{key}_us_{tokens}"] for key in
              ("fused_host", "unfused_host", "fused_device", "unfused_device")}
        print(f"rope+kv write, {tokens} tokens: host {us['fused_host']:.1f} µs fused, {us['unfused_host']:.1f} "
              f"unfused; device {us['fused_device']:.1f} / {us['unfused_device']:.1f}", flush=True)


class PrefillInputs:
    """One sequence: ``cached`` tokens already in the cache plus a chunk of new ones (written)."""

    def __init__(self, cached: int, chunk: int, gen: torch.Generator, block_size: int = 16):
        seq_len = cached + chunk
        num_blocks = triton.cdiv(seq_len, block_size)
        pool = torch.randn(num_blocks, 2, 2, block_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.k_cache, self.v_cache = pool[:, 1, 0], pool[:, 1, 1]
        self.block_tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(1, -1).cuda()
        self.cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
        self.q = torch.randn(chunk, Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        # Causal: query j of the chunk sees cached + j + 1 keys; 2 matmuls of 2 FLOP per MAC.
        self.flops = 4 * Q_HEADS * HEAD_DIM * sum(cached + j + 1 for j in range(chunk))

    def run(self, config=None):
        return launch_paged_prefill(self.q, self.k_cache, self.v_cache, self.block_tables, self.cu,
                                    self.seq_lens, SCALE, out=self.out, max_query_len=self.q.shape[0],
                                    config=config)


def bench_prefill(metrics: dict, gen: torch.Generator) -> None:
    for cached in PREFILL_CACHED:
        tag = f"{PREFILL_CHUNK}_over_{cached}"
        sets = [PrefillInputs(cached, PREFILL_CHUNK, gen) for _ in range(4)]
        ms = _graph_ms(sets, lambda s: s.run())
        inp = sets[0]
        ref = reference.paged_prefill_attention(inp.q, inp.k_cache, inp.v_cache, inp.block_tables, inp.cu,
                                                inp.seq_lens, SCALE)
        metrics[f"prefill_tflops_{tag}"] = inp.flops / ms / 1e9
        metrics[f"prefill_max_rel_err_{tag}"] = _rel_err(inp.run(), ref)
        if cached == 0:
            q = inp.q.transpose(0, 1).unsqueeze(0)
            k = torch.randn(1, KV_HEADS, PREFILL_CHUNK, HEAD_DIM, device="cuda", dtype=DTYPE)
            v = torch.randn_like(k)
            sdpa_ms = _graph_ms([(q, k, v)], lambda c: F.scaled_dot_product_attention(*c, is_causal=True,
                                                                                         enable_gqa=True))
            metrics[f"sdpa_prefill_tflops_{tag}"] = inp.flops / sdpa_ms / 1e9
        print(f"prefill {tag}: {metrics[f'prefill_tflops_{tag}']:.1f} TFLOP/s", flush=True)


def sweep(gen: torch.Generator, shapes: list[tuple[int, int]]) -> list[dict]:
    """Decode tile configs x split counts at ``shapes``, then (for a full sweep) prefill tile
    configs; returns one row per variant."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for num_seqs, context in shapes:
        sets = _input_sets(num_seqs, context, 16, gen)
        nbytes = sets[0].kv_bytes()
        tag = f"{num_seqs}x{context}"
        splits_list = [s for s in (1, 2, 4, 8, 16, 32, 64)
                       if s * MIN_SPLIT_TOKENS <= context and num_seqs * KV_HEADS * s <= 4 * sms]
        for block_n, warps, stages, splits in itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4], splits_list):
            knobs = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
            try:
                ms = _graph_ms(sets, lambda s: _paged(s, **knobs))
            except triton.runtime.errors.OutOfResources as err:
                print(f"decode {knobs}: {err}", flush=True)
                continue
            rows.append(dict(kernel="decode", shape=tag, variant=f"n{block_n}w{warps}s{stages}x{splits}",
                             us=ms * 1e3, tbps=nbytes / ms / 1e9))
        del sets
        torch.cuda.empty_cache()
    if shapes != SWEEP_SHAPES:
        return rows
    configs = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3)]
    for cached in PREFILL_CACHED:
        sets = [PrefillInputs(cached, PREFILL_CHUNK, gen) for _ in range(4)]
        inp = sets[0]
        for config in configs:
            try:
                ms = _graph_ms(sets, lambda s: s.run(config))
            except triton.runtime.errors.OutOfResources as err:
                print(f"prefill config {config}: {err}", flush=True)
                continue
            rows.append(dict(kernel="prefill", shape=f"512_over_{cached}",
                             variant="m{}n{}w{}s{}".format(*config), us=ms * 1e3, tflops=inp.flops / ms / 1e9))
    return rows


def sweep_focus(gen: torch.Generator) -> list[dict]:
    """Time :data:`FOCUS_VARIANTS` at :data:`FOCUS_SHAPE`, each beside contiguous SDPA timed in
    turn with it (so slow drifts of the clock cancel in the ratio)."""
    num_seqs, context = FOCUS_SHAPE
    layouts = {head_major: _input_sets(num_seqs, context, 16, gen, head_major) for head_major in (False, True)}
    nbytes = layouts[False][0].kv_bytes()
    contiguous = [(s.q, *s.contiguous_kv()) for s in layouts[False]]
    rows = []
    for block_n, warps, stages, splits, eviction, head_major in FOCUS_VARIANTS:
        knobs = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits, kv_eviction=eviction)
        paged, sdpa = [], []
        try:
            for _ in range(3):  # in turn with SDPA, as in the main run
                paged.append(_graph_ms(layouts[head_major], lambda s: _paged(s, **knobs)))
                sdpa.append(_graph_ms(contiguous, lambda c: _sdpa_decode(*c)))
        except triton.runtime.errors.OutOfResources as err:
            print(f"decode {knobs}: {err}", flush=True)
            continue
        ms = median(paged)
        variant = f"n{block_n}w{warps}s{stages}x{splits}{'e' if eviction else ''}{'-hm' if head_major else ''}"
        rows.append(dict(kernel="decode", shape=f"{num_seqs}x{context}", variant=variant,
                         us=ms * 1e3, tbps=nbytes / ms / 1e9, vs_sdpa=median(sdpa) / ms))
    return rows


def _print_sweep(rows: list[dict]) -> None:
    print("\nsweep: best variants per (kernel, shape); decode variant = n<BLOCK_N>w<warps>s<stages>x<splits>, "
          "e: K/V loads evict_first, -hm: head-major block layout")
    for kernel, shape in sorted({(r["kernel"], r["shape"]) for r in rows}):
        group = [r for r in rows if (r["kernel"], r["shape"]) == (kernel, shape)]
        group.sort(key=lambda r: r["us"])
        for row in group[:8]:
            unit = f"{row['tbps']:.2f} TB/s" if "tbps" in row else f"{row['tflops']:.1f} TFLOP/s"
            ratio = f"  {row['vs_sdpa']:.3f} of SDPA" if "vs_sdpa" in row else ""
            print(f"  {kernel:7} {shape:14} {row['variant']:14} {row['us']:9.1f} us  {unit}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", nargs="*", metavar="NxCTX",
                        help="time tuning variants instead (decode at these shapes; all, and prefill, if none "
                             "named; 'focus': the curated 16x2048 variants beside SDPA)")
    parser.add_argument("--long-tail", action="store_true",
                        help="time long-tail decode batches at both graph split counts instead")
    parser.add_argument("--rope-kv", action="store_true",
                        help="time RoPE fused with the KV write beside the two kernels instead")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: bench/results/<benchmark>/ (kernels, kernels_long_tail, kernels_rope_kv)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    if args.sweep is not None:
        if args.sweep == ["focus"]:
            rows = sweep_focus(gen)
        else:
            rows = sweep(gen, [tuple(map(int, s.split("x"))) for s in args.sweep] or SWEEP_SHAPES)
        out_dir = args.out_dir or results_dir("kernels")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
        _print_sweep(rows)
        return
    props = torch.cuda.get_device_properties(0)
    if args.long_tail:
        metrics = {}
        bench_long_tail(metrics, gen)
        workload = {"dtype": "bfloat16", "num_q_heads": Q_HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                    "block_size": 16, "batches": LONG_TAIL_BATCHES, "split_bound": LONG_TAIL_BOUND,
                    "mixes": {mix: lengths(4) for mix, lengths in LONG_TAIL_MIXES.items()},
                    "sm_count": props.multi_processor_count, "timing": "median of CUDA-graph replays"}
        path = write_result("kernels_long_tail", {k: round(v, 6) for k, v in metrics.items()}, workload,
                            tag=gpu_tag(props.name), out_dir=args.out_dir, gpu=props.name)
        print(f"wrote {path}")
        return
    if args.rope_kv:
        metrics = {}
        bench_rope_kv(metrics, gen)
        workload = {"dtype": "bfloat16", "num_q_heads": Q_HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                    "block_size": 16, "tokens": ROPE_KV_TOKENS, "rounds": ROPE_KV_ROUNDS, "calls": ROPE_KV_CALLS,
                    "timing": "host: queued calls back to back, per call, median of rounds in turn; device: "
                              "median of CUDA-graph replays"}
        path = write_result("kernels_rope_kv", {k: round(v, 6) for k, v in metrics.items()}, workload,
                            tag=gpu_tag(props.name), out_dir=args.out_dir, gpu=props.name)
        print(f"wrote {path}")
        return
    metrics: dict[str, float] = {"d2d_copy_tbps": copy_bandwidth_tbps()}
    print(f"{props.name}: device-to-device copy {metrics['d2d_copy_tbps']:.2f} TB/s", flush=True)
    bench_decode(metrics, gen)
    bench_prefill(metrics, gen)
    workload = {
        "dtype": "bfloat16", "num_q_heads": Q_HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "block_size": 16, "decode_shapes": [f"{n}x{c}" for n, c in DECODE_SHAPES],
        "decode_block_sizes_at_64x2048": BLOCK_SIZES, "prefill_chunk": PREFILL_CHUNK,
        "prefill_cached": PREFILL_CACHED, "sm_count": props.multi_processor_count,
        "timing": "median of CUDA-graph replays, >= 16 calls per graph rotating over input sets "
                  "spanning >= 256 MiB; *_eager_us_*: triton.testing.do_bench median, L2 flushed, "
                  "host launch overhead included",
        "bandwidth": "K+V bytes read once / time, TB/s",
    }
    path = write_result("kernels", {k: round(v, 6) for k, v in metrics.items()}, workload, tag=gpu_tag(props.name),
                        out_dir=args.out_dir, gpu=props.name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
