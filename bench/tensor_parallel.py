"""Tensor parallelism on one host: Llama-3-8B (random bf16 weights) at TP=2 against TP=1.

Each setting runs in a process of its own (one engine holds the GPUs it uses; rank 0 on
``cuda:0``, rank 1 on ``cuda:1``), the same workload in both:

- decode step at batch 1, 8, 32 and 128: the median wall time of the engine's steps in which
  every running sequence decodes (scheduling, the step broadcast, the CUDA graph replay and
  sampling included), prompts of 256-768 random token ids, 64 new tokens (128 at batch 128);
- offline throughput: ``LLM.generate`` of the usual workload (``bench/throughput.py``: 128
  prompts of 256-768 tokens, 128 new tokens, greedy, EOS ignored), the second of two runs;
- greedy agreement: 64 prompts x 64 tokens, greedy with the top-5 log-probabilities; the share of
  positions where TP=2 picks TP=1's token, the largest and the mean |Δ log-prob| of the picked
  token over the positions before a sequence's first disagreement, and the share of first
  disagreements that are near-ties (each side's token in the other's top 5). The control is
  TP=1 against itself run one prompt at a time (other batch sizes, so other GEMM and graph
  shapes: the bfloat16 rounding noise any engine has between two batchings). Random weights
  give near-flat logits (the median gap between the top two log-probabilities is reported):
  one rounding difference flips a near-tie and the greedy sequences part from there on, so
  agreement over 64 tokens measures how soon the first flip comes; it is judged against the
  control, not as an absolute share.

Metrics (benchmark ``tensor_parallel``, model ``llama-3-8b``): ``tp2_decode_speedup_b{1,8,32,128}``,
``tp2_throughput_ratio``, ``tp2_greedy_agreement``, ``tp2_{max,mean}_logprob_diff``,
``tp2_disagreements_in_top5``, the control's ``tp1_batching_*``, and each setting's raw figures
(``tp{1,2}_decode_step_ms_b*``, ``tp{1,2}_gpu_busy_ms_b1``, ``tp{1,2}_output_tokens_per_s``,
``tp{1,2}_startup_s``).

Usage: ``python -m bench.tensor_parallel [--quick]`` (two GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

from bench.agreement import agreement, greedy_rows
from bench.common import REPO_ROOT, gpu_tag, write_result
from bench.stats import median
from bench.throughput import decode_step_intervals, make_prompts, run_tandem

MODEL = "llama-3-8b"
DECODE_BATCHES = (1, 8, 32)
THROUGHPUT_REQUESTS = 128
NEW_TOKENS = 128
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 64, 64


def agreement_prompts(vocab_size: int) -> list[list[int]]:
    """The prompts greedy agreement is measured on: 64 of 32-256 random token ids."""
    return make_prompts(AGREEMENT_PROMPTS, vocab_size, lengths=(32, 256), seed=1234)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # progress of a child: what a timeout leaves behind


def measure(tp: int, quick: bool, agreement_only: bool) -> dict:
    """One setting, in this process: the decode steps, the throughput and the greedy outputs."""
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, load_format="dummy", tensor_parallel_size=tp, enable_prefix_caching=False)
    engine = llm.engine
    _log(f"TP={tp}: engine ready after {engine.startup.total_s:.1f} s")
    out: dict = {"startup_s": engine.startup.total_s,
                 "cuda_graphs": len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0}
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    prompts = agreement_prompts(engine.vocab_size)
    start = time.perf_counter()
    out["greedy"] = greedy_rows(llm.generate(prompts, params, use_tqdm=False))
    _log(f"TP={tp}: greedy outputs in {time.perf_counter() - start:.1f} s")
    if tp == 1:
        out["greedy_single"] = greedy_rows([llm.generate([p], params, use_tqdm=False)[0] for p in prompts])
    if not agreement_only:
        for batch in DECODE_BATCHES:
            _, _, stats = run_tandem(llm, make_prompts(batch, engine.vocab_size, seed=batch), 64)
            out[f"decode_step_ms_b{batch}"] = 1e3 * median(decode_step_intervals(stats, batch))
            _log(f"TP={tp}: decode step at batch {batch}: {out[f'decode_step_ms_b{batch}']:.2f} ms")
        out["gpu_busy_ms_b1"] = gpu_busy_ms(llm, make_prompts(1, engine.vocab_size, seed=1))
        prompts = make_prompts(THROUGHPUT_REQUESTS // (8 if quick else 1), engine.vocab_size)
        run_tandem(llm, prompts, 16 if quick else NEW_TOKENS)  # the first run after start-up
        elapsed, tokens, stats = run_tandem(llm, prompts, 16 if quick else NEW_TOKENS)
        out["output_tokens_per_s"] = tokens / elapsed
        if intervals := decode_step_intervals(stats, len(prompts)):
            out[f"decode_step_ms_b{len(prompts)}"] = 1e3 * median(intervals)
        _log(f"TP={tp}: {out['output_tokens_per_s']:.0f} output tokens/s")
    print("RESULT " + json.dumps(out), flush=True)  # before the shutdown: a teardown that hangs loses nothing
    engine.shutdown()
    return out


def gpu_busy_ms(llm, prompts: list[list[int]]) -> float:
    """Rank 0's GPU time per step (its kernels' summed time, from ``torch.profiler``) over a
    greedy run of ``prompts`` with 64 new tokens. Set beside the step's wall time, the rest is
    the host's share of a step (scheduling, the step broadcast, graph launch, sampling); at
    TP > 1 it also counts the time rank 0's all-reduce kernels wait for the other ranks."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, _, stats = run_tandem(llm, prompts, 64)
    return sum(event.self_device_time_total for event in prof.key_averages()) / 1e3 / len(stats)


def run_setting(tp: int, quick: bool = False, agreement_only: bool = False, timeout_s: float = 300) -> dict:
    """:func:`measure` of one tensor-parallel size in a child process (its GPUs' memory is all
    its own, and freed when it exits). A child still running after ``timeout_s`` is killed with
    its ranks; if it had printed its result (only its shutdown hung) the result says so
    (``"shutdown_hung": True``).

    Raises:
        RuntimeError: the child failed, or overran before its result.
    """
    argv = [sys.executable, "-m", "bench.tensor_parallel", "--child", str(tp)]
    argv += ["--quick"] * quick + ["--agreement-only"] * agreement_only
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO_ROOT)
    try:
        stdout, _ = child.communicate(timeout=timeout_s)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # its tensor-parallel ranks too
        stdout, _ = child.communicate()
        hung = True
    line = next((line for line in stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None or (child.returncode and not hung):
        raise RuntimeError(f"TP={tp} child {'overran' if hung else 'failed'} (exit {child.returncode})")
    return {**json.loads(line.removeprefix("RESULT ")), "shutdown_hung": hung}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run; not for the record)")
    parser.add_argument("--child", type=int, default=0, help="(internal) measure this tensor-parallel size")
    parser.add_argument("--agreement-only", action="store_true", help="(internal) greedy outputs only")
    args = parser.parse_args()
    if args.child:
        measure(args.child, args.quick, args.agreement_only)
        return
    one, two = run_setting(1, args.quick), run_setting(2, args.quick)
    metrics = {}
    for tp, result in ((1, one), (2, two)):
        for key, value in result.items():
            if key not in ("greedy", "greedy_single", "cuda_graphs"):
                metrics[f"tp{tp}_{key}"] = round(float(value), 4)
    for key in [k for k in one if k.startswith("decode_step_ms_b") and k in two]:
        metrics[f"tp2_decode_speedup_{key.removeprefix('decode_step_ms_')}"] = round(one[key] / two[key], 4)
    metrics["tp2_throughput_ratio"] = round(two["output_tokens_per_s"] / one["output_tokens_per_s"], 4)
    for prefix, (a, b) in (("tp2", (one["greedy"], two["greedy"])), ("tp1_batching", (one["greedy"], one["greedy_single"]))):
        for key, value in agreement(a, b).items():
            metrics[f"{prefix}_{'greedy_' * (key == 'agreement')}{key}"] = round(value, 4)
    metrics["tp1_median_top2_logprob_gap"] = round(median(p[3] for row in one["greedy"] for p in row), 4)
    gpu = torch.cuda.get_device_name()
    workload = {"model": MODEL, "dtype": "bfloat16", "weights": "random (dummy)", "decode_batches": [*DECODE_BATCHES,
                THROUGHPUT_REQUESTS], "prompt_lens": [256, 768], "new_tokens": NEW_TOKENS,
                "throughput_requests": THROUGHPUT_REQUESTS, "agreement": [AGREEMENT_PROMPTS, AGREEMENT_TOKENS],
                "quick": args.quick, "gpus": 2}
    if not args.quick:
        write_result("tensor_parallel", metrics, workload, tag=gpu_tag(gpu), model=MODEL, gpu=f"{gpu} x2")
    else:
        print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
