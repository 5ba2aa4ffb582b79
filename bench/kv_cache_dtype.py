"""A float8 (e4m3) KV cache against a bfloat16 one on a CUDA GPU, same engine, same run.

Workload: random-weight bfloat16 Llama-3-8B (``load_format="dummy"``), one engine per KV cache
dtype at the same ``gpu_memory_utilization``, prefix caching off; ``--requests`` prompts of
``--prompt-len`` random token ids (seeded 0), ``--new-tokens`` output tokens each, EOS ignored,
greedy. Long contexts, so that the decode step reads much KV beside the weights.

Reported per dtype (``kv_cache_dtype`` record, flat): KV blocks and bytes per block (what a KV
transfer moves per block), output tokens/s, the median decode step at full batch and its
K+V bytes read, the most sequences of this workload the cache holds at once; and the fp8 / bf16
ratios. Accuracy is measured on the CPU by ``bench/fp8_kv_accuracy.py``.

Usage: python -m bench.kv_cache_dtype [--requests 128] [--prompt-len 2048] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.common import gpu_tag, release_engine_memory, write_result
from bench.stats import median
from bench.throughput import decode_step_intervals, full_batch_decodes, make_prompts, run_tandem
from engine import LLM
from engine.runner.kv_cache import KVCache

MODEL = "llama-3-8b"
DTYPES = {"bf16": "auto", "fp8": "fp8_e4m3"}


def measure(kv_cache_dtype: str, prompts: list[list[int]], new_tokens: int, memory: float) -> dict[str, float]:
    """One engine with ``kv_cache_dtype``: its cache's size and the workload's speed."""
    llm = LLM(MODEL, load_format="dummy", dtype="bfloat16", device="cuda", enable_prefix_caching=False,
              kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=memory)
    engine = llm.engine
    try:
        cache_dtype = engine.kv_pools[0].dtype
        block_bytes = KVCache.bytes_per_block(engine.model_config, engine.config.block_size, cache_dtype)
        run_tandem(llm, prompts[:8], 4)  # warm-up: the first prefills and decodes
        seconds, tokens, stats = run_tandem(llm, prompts, new_tokens)
        decodes = full_batch_decodes(stats, len(prompts))
        blocks_per_seq = -(-(len(prompts[0]) + new_tokens) // engine.config.block_size)
        metrics = {"kv_blocks": engine.num_blocks, "kv_bytes_per_block": block_bytes,
                   "max_concurrent_seqs": engine.num_blocks // blocks_per_seq,
                   "output_tokens_per_s": tokens / seconds}
        if decodes:
            step = median(decode_step_intervals(stats, len(prompts)))
            kv_read = median(s.num_kv_slots_used for s in decodes) * block_bytes / engine.config.block_size
            metrics |= {"decode_step_ms": step * 1e3, "decode_kv_gbytes": kv_read / 1e9}
        return metrics
    finally:
        del llm, engine
        release_engine_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out-dir", type=Path, default=None, help="default: bench/results/kv_cache_dtype/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from engine.loading.presets import PRESETS

    prompts = make_prompts(args.requests, PRESETS[MODEL]["vocab_size"], (args.prompt_len, args.prompt_len))
    results = {name: measure(dtype, prompts, args.new_tokens, args.gpu_memory_utilization)
               for name, dtype in DTYPES.items()}
    metrics = {f"{name}_{key}": value for name, figures in results.items() for key, value in figures.items()}
    for key in ("kv_blocks", "kv_bytes_per_block", "output_tokens_per_s", "decode_step_ms", "decode_kv_gbytes"):
        if key in results["bf16"] and key in results["fp8"]:
            metrics[f"fp8_over_bf16_{key}"] = results["fp8"][key] / results["bf16"][key]
    gpu = torch.cuda.get_device_name()
    write_result("kv_cache_dtype", metrics, {"requests": args.requests, "prompt_len": args.prompt_len,
                                             "new_tokens": args.new_tokens,
                                             "gpu_memory_utilization": args.gpu_memory_utilization},
                 tag=gpu_tag(gpu), out_dir=args.out_dir, model=MODEL, gpu=gpu)


if __name__ == "__main__":
    main()
