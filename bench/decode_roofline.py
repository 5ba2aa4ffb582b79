"""The decode roofline on a CUDA GPU: how close a steady decode step comes to the bytes it must
move, and how much of its wall time the device is busy.

Workload: random-weight bfloat16 models of the presets (``load_format="dummy"``), for each batch
size B in 32, 128, 256: B prompts of 256-768 random token ids (seeded by B), greedy, EOS
ignored, ``NEW_TOKENS`` output tokens, prefix caching off. The engine is stepped directly
(``EngineCore.step``); a steady decode step is one in which all B sequences decode, the first
``SKIP`` of them dropped.

Metrics (``decode_roofline`` records, one per model):

- ``decode_step_ms_b{B}``: the median wall time between the completions of two consecutive steady
  decode steps (under async scheduling a step's own span overlaps the next one's launch, so the
  interval is the step's cost);
- ``bw_fraction_b{B}``: the bytes a step must move (every weight, the embedding table once for a
  model whose head reuses it, plus the K and V of every running sequence's context) over that
  time, as a fraction of the device-to-device copy bandwidth measured in the same run;
- ``gpu_busy_fraction_b{B}``: over ``PROFILED_STEPS`` steady steps under ``torch.profiler``
  (CUPTI), the union of the device's kernel, copy and memset intervals over the window from the
  first one's start to the last one's end (the profiler adds a little launch overhead, so this
  errs low); ``gpu_busy_fraction`` is the one at the largest batch;
- ``kernels_per_step_b{B}`` and ``kernel_ms_per_step_b{B}``: device activities per step and their
  summed time, and ``kernel_ms_b{B}_{group}`` that time by kind of kernel (``KERNEL_GROUPS``: the
  matmuls, the paged attention, the KV write, norms, RoPE, the activation, sampling, copies,
  the rest), which says where a step's device time goes.

Usage: ``python -m bench.decode_roofline [--models llama-3-8b smollm2-135m] [--batches 32,128,256]``
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import copy_bandwidth_tbps, gpu_tag, release_engine_memory, write_result
from bench.stats import median
from bench.throughput import make_prompts
from engine import EngineConfig, EngineCore, SamplingParams
from engine.runner.kv_cache import KVCache

NEW_TOKENS = 160  # at batch 256 the last prompts are prefilled after ~64 steps: ~90 steady steps
SKIP = 2
PROFILED_STEPS = 20
# Kinds of device activity by a word of the kernel's name (the first group that matches).
KERNEL_GROUPS = {"gemm": ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas"), "attention": ("decode_attention",
                 "prefill_attention", "attention"), "kv_write": ("write_kv", "cache_write", "rotary_write"),
                 "norm": ("norm",), "rotary": ("rotary", "rope"), "activation": ("silu", "act"),
                 "sampling": ("sample", "argmax", "topk", "sort", "softmax", "logsumexp", "reduce"),
                 "copy": ("memcpy", "memset", "copy")}


def kernel_group(name: str) -> str:
    """The :data:`KERNEL_GROUPS` kind of a kernel's name, ``"other"`` for none."""
    lowered = name.lower()
    return next((group for group, words in KERNEL_GROUPS.items() if any(w in lowered for w in words)), "other")


def bytes_per_step(engine: EngineCore, kv_tokens: int) -> int:
    """Bytes a decode step of ``kv_tokens`` context tokens must read: every weight (a head tied
    to the embedding table counted once) and their K and V."""
    seen, weights = set(), 0
    for p in engine.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    embedding = engine.model.model.embed_tokens.weight
    if engine.model.lm_head is not None and engine.model.lm_head.weight is not embedding:
        weights -= embedding.numel() * embedding.element_size()  # a gather of B rows, not a read
    per_token = KVCache.bytes_per_block(engine.model_config, engine.config.block_size, engine.dtype)
    return weights + kv_tokens * per_token // engine.config.block_size


def steady_decode(engine: EngineCore, batch: int) -> tuple[list[float], list[int], dict[str, float]]:
    """Run ``batch`` requests; return the wall times between steady decode steps' completions
    (seconds), each such step's context tokens, and the profiled window's device activity."""
    for i, prompt in enumerate(make_prompts(batch, engine.vocab_size, seed=batch)):
        engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                   ignore_eos=True))
    intervals, contexts, profile = [], [], {}
    last, steady = None, 0
    while engine.has_unfinished_requests or engine.has_steps_in_flight:
        if steady == SKIP + 8 and not profile:
            profile = profiled(engine, batch)
            last = None
            continue
        out = engine.step()
        now = time.perf_counter()
        stats = out.stats
        if stats is not None and stats.num_seqs == stats.num_decodes == batch:
            steady += 1
            if steady > SKIP and last is not None:
                intervals.append(now - last)
                contexts.append(stats.num_kv_slots_used)
            last = now
        else:
            last = None
    return intervals, contexts, profile


def profiled(engine: EngineCore, batch: int) -> dict[str, float]:
    """``PROFILED_STEPS`` steps under the profiler: the device's busy fraction of the window,
    its activities per step and their time per step (ms)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    if not spans:
        return {}
    by_group: dict[str, float] = {}
    for e in events:
        group = kernel_group(e.name)
        by_group[group] = by_group.get(group, 0.0) + (e.time_range.end - e.time_range.start) / PROFILED_STEPS / 1e3
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    window = max(e for _, e in spans) - spans[0][0]
    return {f"gpu_busy_fraction_b{batch}": busy / window, f"kernels_per_step_b{batch}": len(spans) / PROFILED_STEPS,
            f"kernel_ms_per_step_b{batch}": sum(e - s for s, e in spans) / PROFILED_STEPS / 1e3,
            **{f"kernel_ms_b{batch}_{group}": ms for group, ms in sorted(by_group.items())}}


def bench_model(name: str, batches: list[int], copy_tbps: float, gpu: str, async_scheduling: bool | None) -> None:
    release_engine_memory()
    engine = EngineCore(name, EngineConfig(dtype="bfloat16", device="cuda", enable_prefix_caching=False,
                                           async_scheduling=async_scheduling), load_format="dummy")
    metrics: dict[str, float] = {"copy_tbps": copy_tbps}
    for batch in batches:
        intervals, contexts, profile = steady_decode(engine, batch)
        step_s = median(intervals)
        moved = median(bytes_per_step(engine, c) for c in contexts)
        metrics[f"decode_step_ms_b{batch}"] = step_s * 1e3
        metrics[f"bw_fraction_b{batch}"] = moved / step_s / 1e12 / copy_tbps
        metrics[f"decode_gbytes_b{batch}"] = moved / 1e9
        metrics[f"decode_steps_b{batch}"] = len(intervals)
        metrics |= profile
        print(f"{name} b{batch}: step {step_s * 1e3:.2f} ms, {moved / 1e9:.2f} GB, "
              f"{metrics[f'bw_fraction_b{batch}']:.3f} of the copy bandwidth, {profile}", flush=True)
    if f"gpu_busy_fraction_b{max(batches)}" in metrics:
        metrics["gpu_busy_fraction"] = metrics[f"gpu_busy_fraction_b{max(batches)}"]
    workload = {"batches": batches, "prompt_lens": [256, 768], "new_tokens": NEW_TOKENS, "greedy": True,
                "ignore_eos": True, "dtype": "bfloat16", "weights": "random (load_format=dummy)",
                "async_scheduling": engine.async_scheduling, "step_time": "interval between steady steps' completions",
                "gpu_busy": f"torch.profiler (CUPTI) union of device activity over {PROFILED_STEPS} steps"}
    del engine
    release_engine_memory()
    write_result("decode_roofline", {k: round(v, 5) for k, v in metrics.items()}, workload,
                 tag=f"{name}-{gpu_tag(gpu)}", model=name, gpu=gpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-3-8b", "smollm2-135m"])
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--sync", action="store_true", help="schedule synchronously (async scheduling off)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_roofline.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_properties(0).name
    copy_tbps = copy_bandwidth_tbps()
    print(f"{gpu}: device-to-device copy {copy_tbps:.2f} TB/s", flush=True)
    for name in args.models:
        bench_model(name, [int(b) for b in args.batches.split(",")], copy_tbps, gpu, False if args.sync else None)


if __name__ == "__main__":
    main()
