"""Prefix caching on a CUDA GPU: throughput and time to first token with it on and off.

Workload: llama-3-8b (random bfloat16 weights, ``load_format="dummy"``), 256 requests, each a
1024-token system prompt shared by all followed by a unique 32-96-token question (random token
ids, seeded 0), 128 output tokens, greedy, EOS ignored. Every request is added at t=0 and the
benchmark drives ``EngineCore.step()`` itself: a request's TTFT is the time from t=0 to the end
of the step that produced its first token. One engine runs both cases, prefix caching off
first (``KVCacheManager.enable_prefix_caching``), so that the cached run starts from an empty
cache and pays for the system prompt once.

Metrics: ``throughput_speedup`` (output tokens/s on / off), ``ttft_p50_speedup`` and
``ttft_p99_speedup`` (TTFT off / on), ``hit_rate`` (prompt tokens served from the prefix cache
over prompt tokens looked up, in the cached run), and each case's raw numbers.

Usage: python -m bench.prefix_cache [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import gpu_tag, write_result
from bench.stats import quantiles
from engine import EngineConfig, EngineCore, SamplingParams

MODEL = "llama-3-8b"
NUM_REQUESTS = 256
SYSTEM_TOKENS = 1024
QUESTION_LENS = (32, 96)
NEW_TOKENS = 128


def make_prompts(count: int, vocab_size: int, system_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts: one shared random system prompt, then a unique random question each."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab_size, (system_tokens,), generator=gen).tolist()
    lens = torch.randint(QUESTION_LENS[0], QUESTION_LENS[1] + 1, (count,), generator=gen).tolist()
    return [system + torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lens]


def run(engine: EngineCore, prompts: list[list[int]], new_tokens: int, tag: str) -> dict[str, float]:
    """Add every prompt at t=0, step until all finish; returns throughput and TTFT percentiles."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    kv = engine.kv_manager
    queries, hits = kv.prefix_queries, kv.prefix_hits
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    ttft: dict[str, float] = {}
    tokens = finished = 0
    while finished < len(prompts):
        outputs = engine.step().outputs
        now = time.perf_counter()  # the step's tokens are on the host: it has synchronized
        for out in outputs:
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = now - start
            if out.finished:
                finished += 1
                tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    times = list(ttft.values())
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, **quantiles(times, "ttft", (50, 99)),
            "hit_rate": (kv.prefix_hits - hits) / max(1, kv.prefix_queries - queries)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 requests, 16 output tokens (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/prefix_cache.py needs a CUDA GPU")
    count, new_tokens = (32, 16) if args.quick else (NUM_REQUESTS, NEW_TOKENS)
    engine = EngineCore(MODEL, EngineConfig(dtype="bfloat16", device="cuda"), load_format="dummy")
    prompts = make_prompts(count, engine.vocab_size, SYSTEM_TOKENS)

    engine.kv_manager.enable_prefix_caching = False
    off = run(engine, prompts, new_tokens, "off")
    engine.kv_manager.enable_prefix_caching = True
    on = run(engine, prompts, new_tokens, "on")
    metrics = {
        "throughput_speedup": on["tokens_per_s"] / off["tokens_per_s"],
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
        "hit_rate": on["hit_rate"],
        **{f"{key}_on": value for key, value in on.items() if key != "hit_rate"},
        **{f"{key}_off": value for key, value in off.items() if key != "hit_rate"},
        "startup_s": engine.startup.total_s,
    }
    gpu = torch.cuda.get_device_properties(0).name
    workload = {"requests": count, "system_prompt_tokens": SYSTEM_TOKENS, "question_lens": QUESTION_LENS,
                "new_tokens": new_tokens, "greedy": True, "ignore_eos": True, "dtype": "bfloat16",
                "arrivals": "all at t=0; TTFT = t=0 to the end of the step that produced the first token",
                "engine": "EngineConfig defaults, one engine: prefix caching off, then on", "quick": args.quick}
    write_result("prefix_cache", {k: round(v, 4) for k, v in metrics.items()}, workload,
                 tag=f"{MODEL}-{gpu_tag(gpu)}", model=MODEL, gpu=gpu)
    print("\n| prefix caching | tok/s | TTFT p50 s | TTFT p99 s |\n|---|---|---|---|")
    for name, case in (("off", off), ("on", on)):
        print(f"| {name} | {case['tokens_per_s']:.0f} | {case['ttft_p50_s']:.3f} | {case['ttft_p99_s']:.3f} |")
    print(f"\nspeedups: throughput {metrics['throughput_speedup']:.2f}x, TTFT p50 {metrics['ttft_p50_speedup']:.2f}x, "
          f"p99 {metrics['ttft_p99_speedup']:.2f}x; hit rate {metrics['hit_rate']:.3f}", flush=True)


if __name__ == "__main__":
    main()
