"""Offline throughput on a CUDA GPU: Tandem's ``LLM.generate`` against transformers' ``generate``
(static padded batches) and ``generate_batch`` (continuous batching).

Workload (issue 10): random-weight bfloat16 models of the presets in ``engine/loading/presets.py``
(``load_format="dummy"``; transformers builds the same config directly on the GPU), prompts of
256-768 random token ids (seeded 0), 128 output tokens each, EOS ignored, greedy; 128 requests
for llama-3-8b, 256 for smollm2-135m. Tandem runs twice on one engine with prefix caching off
(the repeat resubmits the same prompts; random prompts share no prefix anyway), the first run
right after start-up, which is timed separately; transformers runs once per method after a tiny
warm-up (its ``generate`` with SDPA on one padded batch of the first 64 and of the first 128
prompts, every batch of the workload having the same length distribution; ``generate_batch``
on all prompts, its own start-up included as a caller sees it).

Reported per model (``throughput`` records): output tokens/s of both Tandem runs and of each
transformers method, the speedups, start-up, peak GPU memory (the caching allocator's reserved
peak: Tandem's includes its KV cache, sized to ``gpu_memory_utilization``), the KV cache's
reservation waste (allocated-but-unused token slots / allocated slots of the running sequences,
averaged over steps), and the median decode step at full batch with its host preparation.

The decode roofline has a benchmark of its own (:mod:`bench.decode_roofline`).

Usage: python -m bench.throughput [--models llama-3-8b smollm2-135m] [--quick] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from bench.common import gpu_tag, write_result
from bench.stats import mean, median
from engine import LLM, SamplingParams
from engine.outputs import StepStats
from engine.loading.presets import PRESETS

NUM_REQUESTS = {"llama-3-8b": 128, "smollm2-135m": 256}
NEW_TOKENS = 128
PROMPT_LENS = (256, 768)
HF_STATIC_BATCHES = (64, 128)
GIB = 2**30


def make_prompts(count: int, vocab_size: int, lengths: tuple[int, int] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids, lengths uniform in ``lengths`` (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in sizes]


def _sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def run_tandem(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, list[StepStats]]:
    """``llm.generate`` over all prompts; returns (seconds, output tokens, every step's stats)."""
    engine, stats = llm.engine, []
    step = engine.step

    def recording_step():
        out = step()
        if out.stats is not None:
            stats.append(out.stats)
        return out

    engine.step = recording_step
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = _sync_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = _sync_time() - start
    finally:
        del engine.step
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), stats


def full_batch_decodes(stats: list[StepStats], batch: int, skip: int = 2) -> list[StepStats]:
    """Steady-state decode steps: every one of ``batch`` running sequences decoding (the first
    ``skip`` such steps dropped)."""
    steps = [s for s in stats if s.num_seqs == s.num_decodes == batch]
    return steps[skip:] if len(steps) > skip else steps


def decode_step_intervals(stats: list[StepStats], batch: int, skip: int = 2) -> list[float]:
    """Seconds between the completions of consecutive steady decode steps of ``batch`` sequences
    (:func:`full_batch_decodes`): a step's cost, also where steps overlap (async scheduling)."""
    steps = [s for s in stats if s.num_seqs == s.num_decodes == batch]
    return [b.completed_at - a.completed_at for a, b in zip(steps, steps[1:])][skip:]


def kv_waste(stats: list[StepStats]) -> float:
    """Mean over steps of allocated-but-unused KV slots / allocated slots."""
    fractions = [1 - s.num_kv_slots_used / s.num_kv_slots_allocated for s in stats if s.num_kv_slots_allocated]
    return mean(fractions)


def hf_model(name: str):
    """transformers' Llama of the preset's config, random bfloat16 weights built on the GPU, SDPA."""
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in PRESETS[name].items() if k != "model_type"})
    config.eos_token_id = None  # generate every token asked for
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_static(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy ``generate`` of one left-padded batch; returns output tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    with torch.inference_mode():
        start = _sync_time()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
        elapsed = _sync_time() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def hf_generate_batch(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy ``generate_batch`` (continuous batching, paged SDPA) of all prompts; output tokens/s."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    # Not under inference_mode: its generation thread updates tensors it created outside it.
    start = _sync_time()
    outs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    elapsed = _sync_time() - start
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    if tokens != len(prompts) * new_tokens:
        print(f"warning: generate_batch produced {tokens} tokens, expected {len(prompts) * new_tokens}", flush=True)
    return tokens / elapsed


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def bench_model(name: str, args, gpu: str) -> None:
    count = NUM_REQUESTS[name] // (8 if args.quick else 1)
    new_tokens = 16 if args.quick else NEW_TOKENS
    vocab = PRESETS[name]["vocab_size"]
    prompts = make_prompts(count, vocab)
    metrics: dict[str, float] = {}

    free_gpu()
    # No prefix caching: the repeated run resubmits the same prompts, which would hit the cache.
    llm = LLM(name, load_format="dummy", dtype="bfloat16", device="cuda", enable_prefix_caching=False)
    startup = llm.engine.startup
    first_s, tokens, _ = run_tandem(llm, prompts, new_tokens)
    repeat_s, _, stats = run_tandem(llm, prompts, new_tokens)
    metrics["output_tokens_per_s_first_run"] = tokens / first_s
    metrics["output_tokens_per_s"] = tokens / repeat_s
    metrics["first_run_vs_repeat"] = repeat_s / first_s
    metrics["startup_s"] = startup.total_s
    metrics["startup_warmup_s"] = startup.warmup_s
    metrics["startup_cuda_graph_s"] = startup.cuda_graph_s
    metrics["kv_waste_fraction"] = kv_waste(stats)
    decodes = full_batch_decodes(stats, count)
    if intervals := decode_step_intervals(stats, count):
        metrics[f"decode_step_ms_b{count}"] = median(intervals) * 1e3
    if decodes:
        metrics[f"decode_prepare_ms_b{count}"] = median(s.prepare_s for s in decodes) * 1e3
        metrics[f"decode_cuda_graph_size_b{count}"] = decodes[0].cuda_graph_size or 0
    metrics["steps"] = len(stats)
    metrics["kv_cache_blocks"] = llm.engine.num_blocks
    metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_reserved() / GIB
    del llm
    free_gpu()

    hf_errors = {}
    if not args.skip_hf:
        model = hf_model(name)
        hf_static(model, prompts[:2], 2)  # load kernels
        static = {}
        for batch in HF_STATIC_BATCHES:
            batch = batch // 8 if args.quick else batch
            try:
                static[batch] = hf_static(model, prompts[:batch], new_tokens)
                metrics[f"hf_static_b{batch}_tokens_per_s"] = static[batch]
            except torch.cuda.OutOfMemoryError as err:  # a result for the other batch size is still worth having
                hf_errors[f"static_b{batch}"] = str(err).splitlines()[0]
                free_gpu()
        gc.collect()
        torch.cuda.empty_cache()  # generate_batch sizes its KV cache from the device's free memory
        gb = hf_generate_batch(model, prompts, new_tokens)
        if gb > 0:
            metrics["hf_generate_batch_tokens_per_s"] = gb
        else:
            hf_errors["generate_batch"] = "no tokens (see its log above)"
        metrics["hf_peak_gpu_memory_gib"] = torch.cuda.max_memory_reserved() / GIB
        del model
        free_gpu()
        if static:
            metrics["hf_static_tokens_per_s"] = max(static.values())
            metrics["speedup_vs_hf_static"] = metrics["output_tokens_per_s"] / metrics["hf_static_tokens_per_s"]
            metrics["speedup_vs_hf_static_first_run"] = (metrics["output_tokens_per_s_first_run"]
                                                         / metrics["hf_static_tokens_per_s"])
        if "hf_generate_batch_tokens_per_s" in metrics:
            metrics["speedup_vs_hf_generate_batch"] = (metrics["output_tokens_per_s"]
                                                       / metrics["hf_generate_batch_tokens_per_s"])

    workload = {"requests": count, "prompt_lens": PROMPT_LENS, "new_tokens": new_tokens, "greedy": True,
                "ignore_eos": True, "dtype": "bfloat16", "weights": "random (load_format=dummy)",
                "tandem": "LLM defaults (block_size 16, max_num_seqs 256, max_num_batched_tokens 2048, "
                          "gpu_memory_utilization 0.9, CUDA graphs) but prefix caching off (the repeated run "
                          "resubmits the same prompts)",
                "hf_static": f"generate, SDPA, one left-padded batch of the first B prompts, B in {HF_STATIC_BATCHES}",
                "hf_generate_batch": "generate_batch over all prompts (attn sdpa requested; it switches to its "
                                     "paged variant), its start-up included",
                "quick": args.quick, "hf_errors": hf_errors}
    write_result("throughput", {k: round(v, 4) for k, v in metrics.items()}, workload,
                 tag=f"{name}-{gpu_tag(gpu)}", model=name, gpu=gpu)
    _print_table(name, metrics)


def _print_table(name: str, m: dict) -> None:
    def cell(key, fmt="{:.0f}"):
        return fmt.format(m[key]) if key in m else "-"

    print(f"\n| {name} | tok/s | vs HF static | vs HF generate_batch |\n|---|---|---|---|")
    print(f"| Tandem, repeated run | {cell('output_tokens_per_s')} | {cell('speedup_vs_hf_static', '{:.2f}x')} "
          f"| {cell('speedup_vs_hf_generate_batch', '{:.2f}x')} |")
    print(f"| Tandem, first run | {cell('output_tokens_per_s_first_run')} "
          f"| {cell('speedup_vs_hf_static_first_run', '{:.2f}x')} | |")
    print(f"| HF generate (static) | {cell('hf_static_tokens_per_s')} | | |")
    print(f"| HF generate_batch | {cell('hf_generate_batch_tokens_per_s')} | | |")
    print(f"\nstart-up {cell('startup_s', '{:.1f}')} s, peak GPU memory {cell('peak_gpu_memory_gib', '{:.1f}')} GiB, "
          f"KV waste {cell('kv_waste_fraction', '{:.3f}')}, first run / repeat {cell('first_run_vs_repeat', '{:.3f}')}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(NUM_REQUESTS), choices=list(NUM_REQUESTS))
    parser.add_argument("--quick", action="store_true", help="1/8 of the requests, 16 output tokens (a smoke run)")
    parser.add_argument("--skip-hf", action="store_true", help="Tandem only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/throughput.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_properties(0).name
    for name in args.models:
        bench_model(name, args, gpu)


if __name__ == "__main__":
    main()
