"""The published results: README.md's headline table and docs/benchmarks.md, from bench/results/.

``python -m bench.report`` rewrites both (the README between its ``<!-- results:begin -->`` and
``<!-- results:end -->`` markers) and draws the plots docs/benchmarks.md shows
(``docs/plots/*.png``, with matplotlib: the ``bench`` extra). ``python -m bench.report --check``
exits 1, naming the file, when a committed table is not what the records give or a plot it cites
is missing; it draws nothing and does not need matplotlib.

What a table holds (records read by :mod:`bench.records`, which says how older files are read
and which are skipped): per benchmark, the newest record of each model × device (the record's
``gpu`` or ``machine``) × variant, a variant being the workload fields that make a record another
measurement (:data:`BENCHMARKS`: e.g. the transfer's devices and KV dtype, a serving run's
workload, setup and settings); each row cites its file. The serving benchmark's open-loop runs
are a sweep over request rates: one row per setup with its best goodput over the rates (the
newest run at each rate), and the comparisons of setups (``serving_2gpu``) get a plot of goodput
and ITL against the rate; the step benchmarks get step time against batch size or chunk tokens.
The README's table shows a few metrics of a few benchmarks: :data:`HEADLINES`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO_ROOT
from bench.records import Record, load, newest
from bench.serving_compare import SETUPS, runs_of, slos_of

README = Path("README.md")
BENCHMARKS_MD = Path("docs/benchmarks.md")
PLOTS = Path("docs/plots")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NOT_RECORDED = "not recorded"  # a comparison written before its records named their settings


@dataclass(frozen=True)
class Column:
    """A metric shown in a table: ``title``, the record's ``metric`` times ``scale`` (e.g. 1e3:
    seconds shown as milliseconds), to ``digits`` significant digits."""

    title: str
    metric: str
    scale: float = 1.0
    digits: int = 3


@dataclass(frozen=True)
class Curve:
    """A plot of one record: each metric matching ``pattern`` is a point; its ``x`` group is the
    abscissa, the other groups fill ``label`` (the line it belongs to)."""

    pattern: str
    label: str
    x_title: str
    y_title: str


@dataclass(frozen=True)
class Benchmark:
    """How one benchmark's records are tabled.

    Attributes:
        title: the section's title.
        about: one sentence: what the benchmark measures.
        variant: the ``(column title, value)`` pairs that make a record another measurement than
            one of the same model and device (none: the newest record of each model × device).
        columns: the metrics shown.
        curve: a plot of each row, if a curve says more than its numbers.
    """

    title: str
    about: str
    variant: Callable[[Record], tuple[tuple[str, str], ...]] = lambda record: ()
    columns: tuple[Column, ...] = ()
    curve: Curve | None = None


def _slo(ttft: float, tpot: float) -> str:
    return f"{ttft:g} s / {tpot * 1e3:g} ms"


def _device(name: str) -> str:
    return "cuda:0" if name == "cuda" else name  # records of one GPU once named it "cuda"


def _transfer(record: Record) -> tuple[tuple[str, str], ...]:
    w = record.workload
    return (("from → to", f"{_device(w.get('device', '?'))} → {_device(w.get('peer_device', '?'))}"),
            ("KV dtype", w.get("dtype", "?")))


def _comparison(record: Record) -> tuple[tuple[str, str], ...]:
    return (("workload", record.workload.get("name", "?")), ("SLO (TTFT / TPOT)", _slo(*slos_of(record.workload)[0])),
            ("settings", settings(record.workload) if "env" in record.workload else NOT_RECORDED))


def settings(workload: dict) -> str:
    """A serving run's non-default settings: its ``TANDEM_*`` environment (``(decode)``: the
    split setups' decode workers only), local prefill turned off, the decode workers' KV spot-check
    rate (where recorded), and (a comparison's) adaptive placement aiming at ITL rather than TPOT."""
    items = [f"{k.removeprefix('TANDEM_')}={v or chr(34) * 2}" for k, v in sorted(workload.get("env", {}).items())]
    items += [f"{k.removeprefix('TANDEM_')}={v} (decode)" for k, v in sorted(workload.get("decode_env", {}).items())]
    if workload.get("local_prefill_max_tokens") == 0:
        items.append("LOCAL_PREFILL_MAX_TOKENS=0")
    if "kv_spot_check_rate" in workload:
        items.append(f"KV_SPOT_CHECK_RATE={workload['kv_spot_check_rate']:.4g}")
    if workload.get("aim") == "itl":
        items.append("adaptive aiming at ITL")
    return ", ".join(items)


def _goodput_columns() -> tuple[Column, ...]:
    return tuple(Column(f"goodput {setup} (req/s)", f"goodput_rps_{setup}") for setup in SETUPS) + (
        Column("adaptive / colocated", "adaptive_over_colocated"),
        Column("adaptive / best fixed", "adaptive_over_best_fixed"), Column("disagg / colocated", "goodput_ratio"))


_ACCURACY = (Column("greedy agreement", "greedy_agreement"), Column("mean |Δ log-prob|", "mean_logprob_diff"),
             Column("first disagreements in top 5", "disagreements_in_top5"),
             Column("perplexity ratio", "perplexity_ratio", digits=4))

BENCHMARKS: dict[str, Benchmark] = {
    "serving_2gpu": Benchmark(
        "Serving: disaggregated, colocated and adaptive on the same GPUs",
        "`python -m bench.serving --setups disagg,colocated,adaptive`: one workload, open-loop Poisson "
        "arrivals at a sweep of rates, each setup's best goodput (requests/s within both SLOs) over the "
        "rates, at the first SLO pair. The same setup's best goodput moves 5-20% from one lease of a "
        "machine to the next: compare the setups within a row.", _comparison, _goodput_columns()),
    "serving": Benchmark("Serving", ""),  # tabled by serving_tables()
    "cpu_stream": Benchmark(
        "CPU: one stream and a batch, against llama.cpp and transformers",
        "`python -m bench.cpu_stream`: the default GGUF (Q4_1), 16 chat prompts x 64 greedy tokens, best of "
        "the rounds; offline engines in one process, the gateway through `tandem serve --local`.", columns=(
            Column("Tandem 1 stream (tok/s)", "tandem_tok_s_one_stream"),
            Column("Tandem 16 at once (tok/s)", "tandem_tok_s_batch16"),
            Column("llama.cpp 1 stream", "llamacpp_tok_s_one_stream"),
            Column("llama.cpp 16", "llamacpp_tok_s_batch16"),
            Column("over llama.cpp, 1 stream", "tandem_over_llamacpp_one_stream"),
            Column("over llama.cpp, 16", "tandem_over_llamacpp_batch16"),
            Column("gateway / offline, 1 stream", "gateway_over_offline_one_stream"),
            Column("TTFT p50 (ms)", "tandem_ttft_s_p50", 1e3))),
    "cpu_prefill": Benchmark(
        "CPU: time to first token of long prompts, against llama.cpp and transformers",
        "`python -m bench.cpu_prefill`: the default GGUF (Q4_1), one prompt of 128, 512 or 1536 tokens, one "
        "greedy token, prefix caching off, best of the rounds, every engine in one process run.", columns=(
            Column("Tandem 128 (ms)", "tandem_ttft_s_128", 1e3), Column("512", "tandem_ttft_s_512", 1e3),
            Column("1536", "tandem_ttft_s_1536", 1e3), Column("llama.cpp 512 (ms)", "llamacpp_ttft_s_512", 1e3),
            Column("llama.cpp 1536", "llamacpp_ttft_s_1536", 1e3),
            Column("over llama.cpp, 512", "tandem_over_llamacpp_512"),
            Column("over llama.cpp, 1536", "tandem_over_llamacpp_1536"),
            Column("over transformers, 1536", "tandem_over_transformers_1536"))),
    "offline_cpu": Benchmark(
        "CPU: offline float32 against transformers",
        "`python -m bench.offline_cpu`: SmolLM2-135M float32, 16 chat prompts x 64 greedy tokens.", columns=(
            Column("Tandem (tok/s)", "tandem_tok_s"), Column("transformers batched", "hf_batched_tok_s"),
            Column("speedup", "speedup_vs_hf_batched"),
            Column("outputs equal to transformers", "tandem_outputs_equal_hf_sequential"))),
    "throughput": Benchmark(
        "GPU: offline throughput against transformers",
        "`python -m bench.throughput`: random-weight bfloat16 models, 256-768-token prompts, 128 greedy "
        "output tokens.", columns=(
            Column("output tok/s", "output_tokens_per_s"), Column("over HF generate", "speedup_vs_hf_static"),
            Column("over HF generate_batch", "speedup_vs_hf_generate_batch"),
            Column("decode step b128 (ms)", "decode_step_ms_b128"), Column("KV waste", "kv_waste_fraction"),
            Column("start-up (s)", "startup_s"))),
    "decode_roofline": Benchmark(
        "GPU: decode step against the memory ceiling",
        "`python -m bench.decode_roofline`: a full-batch decode step's time, the share of the measured copy "
        "bandwidth its weight and KV reads take, how busy the GPU is over steady steps (profiler), and "
        "the device time of a batch-128 step by kind of kernel.", columns=(
            Column("step b32 (ms)", "decode_step_ms_b32"), Column("step b128 (ms)", "decode_step_ms_b128"),
            Column("step b256 (ms)", "decode_step_ms_b256"), Column("bandwidth share b32", "bw_fraction_b32"),
            Column("bandwidth share b128", "bw_fraction_b128"), Column("bandwidth share b256", "bw_fraction_b256"),
            Column("GPU busy b128", "gpu_busy_fraction_b128"), Column("GPU busy b256", "gpu_busy_fraction_b256"),
            Column("b128 matmuls (ms)", "kernel_ms_b128_gemm"),
            Column("b128 attention (ms)", "kernel_ms_b128_attention"), Column("b128 other (ms)", "kernel_ms_b128_other")),
        curve=Curve(r"decode_step_ms_b(?P<x>\d+)", "decode step", "batch size (sequences)", "step time (ms)")),
    "step_overhead": Benchmark(
        "GPU: a decode step and a mixed step",
        "`python -m bench.step_overhead`: a step of 1 or 64 decodes, alone and with a fresh prompt chunk, "
        "timed one at a time (median), with CUDA graphs (decode graph, piecewise graphs) and eagerly.", columns=(
            Column("64 decodes (ms)", "graphs_b64_c128_decode_step_ms"),
            Column("64 decodes, eager (ms)", "eager_b64_c128_decode_step_ms"),
            Column("+128-token chunk (ms)", "graphs_b64_c128_mixed_step_ms"),
            Column("+512 (ms)", "graphs_b64_c512_mixed_step_ms"),
            Column("+1024 (ms)", "graphs_b64_c1024_mixed_step_ms"),
            Column("+128 launch (ms)", "graphs_b64_c128_mixed_launch_ms"),
            Column("+128 eager (ms)", "eager_b64_c128_mixed_step_ms")),
        curve=Curve(r"(?P<mode>graphs|eager)_b(?P<batch>\d+)_c(?P<x>\d+)_mixed_step_ms",
                    "batch {batch}, {mode}", "prompt chunk beside the batch (tokens)", "step time (ms)")),
    "tensor_parallel": Benchmark(
        "GPU: tensor parallelism",
        "`python -m bench.tensor_parallel`: random-weight Llama-3-8B at TP=1 and TP=2, full-batch decode "
        "steps, offline throughput and greedy agreement.", columns=(
            Column("TP=1 step b1 (ms)", "tp1_decode_step_ms_b1"), Column("TP=2 step b1 (ms)", "tp2_decode_step_ms_b1"),
            Column("TP=2 speedup b1", "tp2_decode_speedup_b1"), Column("TP=2 throughput ratio", "tp2_throughput_ratio"),
            Column("TP=2 agreement", "tp2_greedy_agreement"),
            Column("TP=1 batching agreement", "tp1_batching_greedy_agreement")),
        curve=Curve(r"(?P<tp>tp\d)_decode_step_ms_b(?P<x>\d+)", "{tp}", "batch size (sequences)", "step time (ms)")),
    "kernels": Benchmark(
        "GPU: paged attention kernels",
        "`python -m bench.kernels`: bfloat16, 32 query / 8 KV heads of 128, 16-token blocks; medians of "
        "CUDA-graph replays; bandwidth = K+V bytes / time; SDPA on contiguous data is the ceiling.", columns=(
            Column("1x8192 (TB/s)", "paged_decode_tbps_1x8192"), Column("1x8192 / SDPA", "paged_decode_vs_sdpa_1x8192"),
            Column("16x2048 / SDPA", "paged_decode_vs_sdpa_16x2048"),
            Column("64x2048 / SDPA", "paged_decode_vs_sdpa_64x2048"),
            Column("256x4096 / SDPA", "paged_decode_vs_sdpa_256x4096"),
            Column("prefill 512 over 2048 (TFLOP/s)", "prefill_tflops_512_over_2048"),
            Column("copy (TB/s)", "d2d_copy_tbps"))),
    "kernels_long_tail": Benchmark(
        "GPU: decode batches with a long tail",
        "`python -m bench.kernels --long-tail`: µs a layer for one 3500-token context among 400-token ones, "
        "at the graph's own split count and at the long-tail count.", columns=(
            Column("16 seqs, own splits (µs)", "long_tail_us_16_long_tail_own"),
            Column("16 seqs, long-tail splits (µs)", "long_tail_us_16_long_tail_long_tail"),
            Column("64 seqs, own (µs)", "long_tail_us_64_long_tail_own"),
            Column("64 seqs, long-tail (µs)", "long_tail_us_64_long_tail_long_tail"),
            Column("uniform 400, 16 seqs: own over long-tail", "long_tail_speedup_16_short"))),
    "kernels_rope_kv": Benchmark(
        "GPU: RoPE with the KV write, host cost of a launch",
        "`python -m bench.kernels --rope-kv`: host µs per call of the fused kernel against the two it "
        "replaces, and of Triton's launcher alone.", columns=(
            Column("fused host (µs)", "rope_kv_fused_host_us_64"),
            Column("unfused host (µs)", "rope_kv_unfused_host_us_64"),
            Column("Triton alone (µs)", "rope_kv_triton_only_host_us_64"),
            Column("empty kernel (µs)", "rope_kv_empty_host_us_64"))),
    "kv_transfer": Benchmark(
        "KV transfer between two worker processes",
        "`python -m bench.kv_transfer`: Llama-3-8B blocks, NIXL reads and the gRPC stream, from opening the "
        "transfer to the receiver's acknowledgement (median), against a plain copy between the devices; "
        "`ready`: from the blocks ready, the stream already open (what a request waits for); `digests / "
        "transfer`: both sides' end-to-end digest work over the transfer's time.", _transfer, (
            Column("NIXL 16 blocks (GB/s)", "nixl_gbps_16_blocks"), Column("NIXL 256", "nixl_gbps_256_blocks"),
            Column("NIXL 2048", "nixl_gbps_2048_blocks"), Column("NIXL 256, ready", "nixl_ready_gbps_256_blocks"),
            Column("gRPC 256", "grpc_gbps_256_blocks"), Column("copy", "copy_gbps"),
            Column("digests / transfer, 256", "digest_overhead_fraction_256_blocks"),
            Column("2048", "digest_overhead_fraction_2048_blocks"))),
    "kv_cache_dtype": Benchmark(
        "GPU: an fp8 KV cache",
        "`python -m bench.kv_cache_dtype`: random-weight Llama-3-8B, 128 prompts of 2048 tokens; blocks in "
        "the same memory, the full-batch decode step and output throughput, fp8 e4m3 against bfloat16.", columns=(
            Column("fp8 / bf16 blocks", "fp8_over_bf16_kv_blocks"), Column("bf16 step (ms)", "bf16_decode_step_ms"),
            Column("fp8 step (ms)", "fp8_decode_step_ms"),
            Column("fp8 / bf16 output tok/s", "fp8_over_bf16_output_tokens_per_s"))),
    "prefix_cache": Benchmark(
        "GPU: prefix caching",
        "`python -m bench.prefix_cache`: 256 requests sharing a 1024-token system prompt, prefix caching on "
        "against off.", columns=(
            Column("throughput speedup", "throughput_speedup"), Column("TTFT p50 speedup", "ttft_p50_speedup"),
            Column("TTFT p99 speedup", "ttft_p99_speedup"), Column("hit rate", "hit_rate"))),
    "quantized_accuracy": Benchmark(
        "Accuracy: GGUF weights computed quantized",
        "`python -m bench.quantized_accuracy`: 64 chat prompts x 64 greedy tokens against the dequantized "
        "model; |Δ log-prob| of the picked token before a sequence's first disagreement.", columns=_ACCURACY),
    "fp8_kv_accuracy": Benchmark(
        "Accuracy: an fp8 KV cache",
        "`python -m bench.fp8_kv_accuracy`: 64 chat prompts x 64 greedy tokens against the float32 cache.",
        columns=_ACCURACY),
    "admission": Benchmark(
        "Admission work on the engine thread",
        "`python -m bench.admission`: a 4000-token prompt's block hashing, reservation and join, with the "
        "hashes computed on the engine thread and handed to it.", columns=(
            Column("hash (ms)", "hash_ms"), Column("reserve, hashing on the engine (ms)", "reserve_ms_engine"),
            Column("reserve, hashes handed (ms)", "reserve_ms_handed"), Column("join, handed (ms)", "join_ms_handed"),
            Column("engine thread speedup", "engine_thread_speedup"))),
    "failover": Benchmark(
        "CPU: failover under load",
        "`python -m bench.failover`: 2 prefill + 2 decode workers, 32 closed-loop streams; requests failed "
        "when a worker is killed or frozen, and a burst of 4 MB prompts.", columns=(
            Column("prefill SIGKILL: failed", "prefill_sigkill_failed"),
            Column("decode SIGKILL: failed", "decode_sigkill_failed"),
            Column("decode SIGSTOP: failed", "decode_sigstop_failed"),
            Column("restarted decode worker's first request (s)", "decode_restart_first_request_s"),
            Column("4 MB prompts' delay (ms)", "large_prompt_burst_delay_s", 1e3))),
    "structured_output": Benchmark(
        "Structured output: JSON schemas",
        "`python -m bench.structured_output`: 64 chat prompts, each with its own JSON schema (written in the "
        "prompt too), greedy, up to 128 tokens; the share of answers that parse and validate (`jsonschema`) "
        "with and without the constraint, and the sampler's median time per step (bitmask fill, mask, "
        "sample) at batch 1 and 64.", columns=(
            Column("valid, constrained", "constrained_valid_share"),
            Column("valid, unconstrained", "unconstrained_valid_share"),
            Column("parsed, unconstrained", "unconstrained_parse_share"),
            Column("compile (ms)", "compile_ms_mean"),
            Column("sampler b1 (ms)", "sampler_ms_batch1_unconstrained"),
            Column("sampler b1 constrained (ms)", "sampler_ms_batch1_constrained"),
            Column("sampler b64 (ms)", "sampler_ms_batch64_unconstrained"),
            Column("sampler b64 constrained (ms)", "sampler_ms_batch64_constrained"))),
    "speculative": Benchmark(
        "Speculative decoding: n-gram, suffix and draft-model drafts",
        "`python -m bench.speculative`: input-grounded chats (passages, code edits, extraction, multi-turn), "
        "greedy; tokens per second over no speculation at one stream and at 16 or 64 (above "
        "`disable_by_batch_size`, 2 on the CPU and 4 on CUDA by default, speculation is off), answers equal "
        "to no speculation's, draft tokens accepted and tokens a verification yields; the draft model is "
        "the target itself (`draft_self`) or random weights (`draft_random`), with the time its proposals "
        "take a step; on the CPU, vLLM's CPU build beside it (bf16 weights, its own n-gram method).",
        variant=lambda r: (("workload", "{} prompts x {} tokens, k={}{}".format(
            *(r.workload.get(key, "?") for key in ("one_stream_prompts", "max_tokens", "num_speculative_tokens")),
            f", n-grams from {r.workload['prompt_lookup_min']}" if "prompt_lookup_min" in r.workload else "")),
            ("kernels", "batch-invariant" if r.workload.get("batch_invariant") else "default")),
        columns=(
            Column("1 stream, plain (tok/s)", "cpu_one_stream_tok_s_plain"),
            Column("1 stream, ngram", "cpu_one_stream_speedup_ngram"),
            Column("1 stream, suffix", "cpu_one_stream_speedup_suffix"),
            Column("16 streams, ngram", "cpu_batch16_speedup_ngram"),
            Column("16 streams, suffix", "cpu_batch16_speedup_suffix"),
            Column("GPU batch 1, ngram", "gpu_batch1_speedup_ngram"),
            Column("GPU batch 64, ngram", "gpu_batch64_speedup_ngram"),
            Column("GPU batch 64, suffix", "gpu_batch64_speedup_suffix"),
            Column("equal, ngram", "greedy_equal_fraction_ngram"),
            Column("accepted, ngram", "acceptance_rate_ngram"),
            Column("mean accepted length, ngram", "mean_accepted_length_ngram"),
            Column("accepted, suffix", "acceptance_rate_suffix"),
            Column("accepted, draft self", "acceptance_rate_draft_self"),
            Column("accepted, draft random", "acceptance_rate_draft_random"),
            Column("draft ms a step, self (CPU)", "cpu_one_stream_draft_ms_per_step_draft_self"),
            Column("draft ms a step, self (GPU)", "gpu_batch1_draft_ms_per_step_draft_self"),
            Column("vLLM 1 stream, ngram (tok/s)", "vllm_cpu_one_stream_tok_s_ngram"),
            Column("over vLLM ngram", "cpu_one_stream_ratio_to_vllm_ngram"))),
    "soak": Benchmark(
        "CPU: soak with faults",
        "`python -m bench.soak`: mixed traffic with a fault every 30 s (SIGKILL, SIGSTOP, SIGTERM of workers, "
        "Redis restarts); every request accounted for, nothing leaked.", columns=(
            Column("minutes", "minutes"), Column("sent", "sent"), Column("completed", "completed"),
            Column("failed with a status", "failed_with_status"), Column("hung", "hung"),
            Column("leaked blocks", "leaked_blocks"), Column("leaked fds", "leaked_fds"),
            Column("RSS growth", "rss_growth_fraction"))),
}


@dataclass(frozen=True)
class Headline:
    """One line of the README's table per model × device: ``benchmark``'s rows whose variant has
    the values in ``where``, showing ``metrics``, each ``(label, metric, unit)``."""

    title: str
    benchmark: str
    metrics: tuple[tuple[str, str, str], ...]
    where: tuple[tuple[str, str], ...] = ()


HEADLINES: tuple[Headline, ...] = (
    Headline("Serving goodput, decode-heavy requests beside long prefills (TTFT ≤ 0.5 s, TPOT ≤ 20 ms)",
             "serving_2gpu", (("adaptive", "goodput_rps_adaptive", " req/s"), ("disagg", "goodput_rps_disagg", ""),
                              ("colocated", "goodput_rps_colocated", "")),
             (("workload", "interference"), ("SLO (TTFT / TPOT)", "0.5 s / 20 ms"))),
    Headline("Serving 128 streams, a prefill and a decode worker on one GPU", "serving",
             (("", "service_output_tokens_per_s", " tok/s"), ("", "service_to_offline_ratio", "x the offline engine")),
             (("workload", "random"), ("setup", "adaptive (TPOT)"), ("workers", "1 prefill + 1 decode"),
              ("load", "128 streams"), ("settings", ""))),
    Headline("CPU, one stream and 16 at once, against llama.cpp", "cpu_stream",
             (("1 stream", "tandem_tok_s_one_stream", " tok/s"), ("16", "tandem_tok_s_batch16", " tok/s"),
              ("", "tandem_over_llamacpp_one_stream", "x"), ("", "tandem_over_llamacpp_batch16", "x llama.cpp"))),
    Headline("Offline throughput against transformers", "throughput",
             (("", "output_tokens_per_s", " tok/s"), ("", "speedup_vs_hf_static", "x HF generate"))),
    Headline("Decode step at batch 128 against the memory ceiling", "decode_roofline",
             (("", "decode_step_ms_b128", " ms"), ("", "bw_fraction_b128", " of the copy bandwidth"),
              ("GPU busy", "gpu_busy_fraction_b128", ""))),
    Headline("Speculative decoding (n-gram), one stream on the CPU, over plain decoding and vLLM's", "speculative",
             (("", "cpu_one_stream_speedup_ngram", "x"), ("answers equal", "greedy_equal_fraction_ngram", ""),
              ("accepted", "acceptance_rate_ngram", ""), ("", "cpu_one_stream_ratio_to_vllm_ngram", "x vLLM's n-gram"))),
    Headline("Speculative decoding (n-gram) on a GPU, over plain decoding", "speculative",
             (("batch 1", "gpu_batch1_speedup_ngram", "x"), ("64", "gpu_batch64_speedup_ngram", "x"),
              ("answers equal", "greedy_equal_fraction_ngram", "")), (("kernels", "default"),)),
    Headline("The same with batch-invariant kernels (bf16 answers exact)", "speculative",
             (("batch 1", "gpu_batch1_speedup_ngram", "x"), ("64", "gpu_batch64_speedup_ngram", "x"),
              ("answers equal", "greedy_equal_fraction_ngram", "")), (("kernels", "batch-invariant"),)),
    Headline("A step of 64 decodes and a 512-token prompt chunk", "step_overhead",
             (("", "graphs_b64_c512_mixed_step_ms", " ms"),)),
    Headline("KV transfer of 256 blocks (2 MiB each), GPU to GPU", "kv_transfer",
             (("NIXL", "nixl_gbps_256_blocks", " GB/s"), ("plain copy", "copy_gbps", " GB/s")),
             (("from → to", "cuda:0 → cuda:1"), ("KV dtype", "bfloat16"))),
    Headline("Prefix caching, a shared 1024-token system prompt", "prefix_cache",
             (("throughput", "throughput_speedup", "x"), ("TTFT p50", "ttft_p50_speedup", "x"))),
    Headline("Answers under a JSON schema, 64 prompts with their own schemas", "structured_output",
             (("share valid", "constrained_valid_share", " constrained"), ("", "unconstrained_valid_share", " without"),
              ("sampler added at batch 64", "sampler_added_ms_batch64", " ms a step"))),
    Headline("Soak, a fault every 30 s", "soak",
             (("completed", "completed", ""), ("hung", "hung", ""), ("leaked blocks", "leaked_blocks", ""))),
)


@dataclass(frozen=True)
class Row:
    """One table row: the model, device and variant it is the newest record of, its cells."""

    record: Record
    variant: tuple[tuple[str, str], ...]
    metrics: dict[str, float]


def number(value: float, digits: int = 3) -> str:
    """A table cell: an integer as it is, else ``digits`` significant digits (whole digits kept)."""
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 10 ** digits else f"{value:.{digits}g}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table (a ``|`` in a cell escaped)."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header)] + [line(row) for row in rows]


def _link(record: Record, base: Path) -> str:
    target = Path("../" * len(base.parts)) / record.path if base.parts else record.path
    return f"[{record.path.name}]({target.as_posix()})"


def benchmark_rows(records: list[Record], name: str) -> list[Row]:
    """The newest record of each model × device × variant of ``name``, sorted."""
    spec = BENCHMARKS.get(name, Benchmark(name, ""))
    best = newest((r for r in records if r.benchmark == name), lambda r: (r.model, r.device, spec.variant(r)))
    return [Row(r, spec.variant(r), r.metrics) for _, r in sorted(best.items(), key=lambda kv: kv[0])]


# -- serving: per-run records ----------------------------------------------------------------


def serving_setup(workload: dict) -> str | None:
    """The deployment a serving run measured: ``disagg``, ``colocated``, or ``adaptive`` with the
    objective its placement aimed at (``adaptive (TPOT)``, ``adaptive (ITL)``); ``None`` for
    adaptive placement aimed at another SLO pair than the run's first (that run's goodput counts
    in its comparison, ``serving_2gpu``)."""
    setup = workload.get("setup", "?")
    if setup != "adaptive":
        return setup
    main = tuple(slos_of(workload)[0])
    aim = workload.get("placement_slos_s")
    if aim:
        objective = "itl" if "itl" in aim else "tpot"
        target = (aim["ttft"], aim[objective])
    elif "placement_slo_ttft_itl_s" in workload:
        objective, target = "itl", tuple(workload["placement_slo_ttft_itl_s"])
    else:
        return "adaptive"
    return f"adaptive ({objective.upper()})" if tuple(target) == main else None


def _serving_variant(record: Record) -> tuple[tuple[str, str], ...] | None:
    w = record.workload
    setup = serving_setup(w)
    if setup is None:
        return None
    load = f"{w.get('value', 0):g} streams" if w.get("mode") == "closed" else "open loop"
    workers = f"{w.get('prefill_workers', '?')} prefill + {w.get('decode_workers', '?')} decode"
    return (("workload", w.get("name", "?")), ("setup", setup), ("workers", workers), ("load", load),
            ("SLO (TTFT / TPOT)", _slo(*slos_of(w)[0])), ("settings", settings(w)))


SERVING_CLOSED = (Column("output tok/s", "service_output_tokens_per_s"),
                  Column("/ offline", "service_to_offline_ratio"), Column("TTFT p50 (s)", "ttft_p50_s"),
                  Column("TPOT p50 (ms)", "tpot_p50_s", 1e3), Column("ITL p99 (ms)", "itl_p99_s", 1e3),
                  Column("prompt blocks reused", "reused_block_fraction"))
SERVING_OPEN = (Column("best goodput (req/s)", "goodput_rps"), Column("at (req/s)", "rate_rps"),
                Column("TTFT p99 (s)", "ttft_p99_s"), Column("ITL p99 (ms)", "itl_p99_s", 1e3),
                Column("decode-heavy ITL p99 (ms)", "decode_heavy_itl_p99_s", 1e3))


def serving_rows(records: list[Record]) -> tuple[list[Row], list[Row]]:
    """The serving runs: closed-loop rows (the newest of each model × device × variant), and
    open-loop rows, one per sweep (model × device × variant: the newest run at each rate), with
    the metrics of the rate of best goodput (``rate_rps``: that rate) and the file of that run."""
    runs = [(r, v) for r in records if r.benchmark == "serving" and (v := _serving_variant(r)) is not None]
    closed = newest((r for r, v in runs if r.workload.get("mode") == "closed"),
                    lambda r: (r.model, r.device, _serving_variant(r)))
    closed_rows = [Row(r, _serving_variant(r), r.metrics) for _, r in sorted(closed.items(), key=lambda kv: kv[0])]
    by_rate = newest((r for r, v in runs if r.workload.get("mode") == "open"),
                     lambda r: (r.model, r.device, _serving_variant(r), r.workload.get("value")))
    sweeps: dict[tuple, list[Record]] = defaultdict(list)
    for (model, device, variant, _), record in by_rate.items():
        sweeps[(model, device, variant)].append(record)
    open_rows = []
    for key in sorted(sweeps):
        best = max(sweeps[key], key=lambda r: (r.metrics.get("goodput_rps", 0.0), -r.workload.get("value", 0)))
        rates = sorted(r.workload.get("value", 0) for r in sweeps[key])
        variant = tuple(("rates (req/s)", ", ".join(f"{x:g}" for x in rates)) if title == "load" else (title, value)
                        for title, value in key[2])
        open_rows.append(Row(best, variant, {**best.metrics, "rate_rps": best.workload.get("value", 0)}))
    return closed_rows, open_rows


# -- rendering -------------------------------------------------------------------------------


def _cells(row: Row, columns: tuple[Column, ...]) -> list[str]:
    return [number(row.metrics[c.metric] * c.scale, c.digits) if c.metric in row.metrics else "" for c in columns]


def rows_table(rows: list[Row], columns: tuple[Column, ...], base: Path) -> list[str]:
    """``rows`` as a markdown table: model, device, variant, the columns, the day, the file."""
    titles = [t for t, _ in rows[0].variant] if rows else []
    header = ["model", "device", *titles, *(c.title for c in columns), "date", "file"]
    return table(header, [[row.record.model, row.record.device, *(v for _, v in row.variant),
                           *_cells(row, columns), row.record.day, _link(row.record, base)] for row in rows])


def plot_name(row: Row, benchmark: str) -> str:
    """The plot file of a row: ``<benchmark>-<model>-<device>[-<variant>].png``, lowercased."""
    parts = [benchmark, row.record.model, row.record.device, *(v for _, v in row.variant if v != NOT_RECORDED)]
    return re.sub(r"[^a-z0-9]+", "-", "-".join(parts).lower()).strip("-")[:120] + ".png"


def plotted(benchmark: str, rows: list[Row]) -> list[Row]:
    """The rows of ``benchmark`` that get a plot: every row of a benchmark with a curve; the GPU
    comparisons of setups with open-loop runs."""
    if benchmark == "serving_2gpu":
        return [r for r in rows if r.record.device.startswith("NVIDIA")
                and any(mode == "open" for runs in runs_of(r.metrics).values() for mode, _ in runs)]
    return rows if BENCHMARKS.get(benchmark, Benchmark("", "")).curve else []


def benchmarks_markdown(records: list[Record]) -> tuple[str, dict[str, tuple[str, Row]]]:
    """docs/benchmarks.md, and the plots it cites: file name → (benchmark, row)."""
    base = BENCHMARKS_MD.parent
    plots: dict[str, tuple[str, Row]] = {}
    lines = ["# Benchmarks", "",
             "Generated by `python -m bench.report` from `bench/results/`; do not edit by hand. Each row is "
             "the newest record of its benchmark for one model, device and variant (the workload settings "
             "that make it another measurement), and cites its file; `bench/report.py` says how records are "
             "chosen and `bench/records.py` which are skipped. Times are medians unless a column says "
             "otherwise; goodput is requests per second completed within both SLOs (DistServe).", ""]
    names = [n for n in BENCHMARKS if any(r.benchmark == n for r in records)]
    names += sorted({r.benchmark for r in records} - set(BENCHMARKS))
    for name in names:
        spec = BENCHMARKS.get(name, Benchmark(name, ""))
        if name == "serving":
            closed, open_ = serving_rows(records)
            lines += ["## Serving, one setup at a time", "",
                      "`python -m bench.serving`: a client of the public gRPC API against a local cluster "
                      "(`--setups`: `disagg`, a fixed split of 1 prefill + 1 decode worker; `colocated`, decode "
                      "workers prefilling their own; `adaptive`, the split with each prefill placed by the "
                      "gateway's prediction against the SLO pair, aiming at TPOT or ITL); random-weight models, "
                      "greedy, EOS ignored.", "", "Closed loop (a fixed number of streams):", "",
                      *rows_table(closed, SERVING_CLOSED, base), "",
                      "Open loop (Poisson arrivals), one row per sweep of rates: the rate of best goodput "
                      "and its run:", "", *rows_table(open_, SERVING_OPEN, base), ""]
            continue
        rows = benchmark_rows(records, name)
        lines += [f"## {spec.title}", ""] + ([spec.about, ""] if spec.about else [])
        lines += rows_table(rows, spec.columns, base) + [""]
        for row in plotted(name, rows):
            file = plot_name(row, name)
            plots[file] = (name, row)
            where = ", ".join(v for _, v in row.variant)
            lines += [f"![{name}: {row.record.model} on {row.record.device}{', ' + where if where else ''}]"
                      f"({(PLOTS.relative_to(base) / file).as_posix()})", ""]
    return "\n".join(lines).rstrip("\n") + "\n", plots


def headline_markdown(records: list[Record]) -> str:
    """README.md's table, between the markers (inclusive): each headline's newest row per model
    among those holding its first metric (docs/benchmarks.md has every device's)."""
    closed, _ = serving_rows(records)
    out = []
    for headline in HEADLINES:
        rows = closed if headline.benchmark == "serving" else benchmark_rows(records, headline.benchmark)
        newest: dict[str, Row] = {}  # per model, on whichever device measured it last
        for row in rows:
            if set(headline.where) <= set(row.variant) and headline.metrics[0][1] in row.metrics:
                model = row.record.model
                if model not in newest or row.record.date > newest[model].record.date:
                    newest[model] = row
        for row in newest.values():
            result = ", ".join(f"{label + ' ' if label else ''}{number(row.metrics[metric])}{unit}"
                               for label, metric, unit in headline.metrics if metric in row.metrics)
            out.append([headline.title, row.record.model, row.record.device, result, _link(row.record, Path())])
    return "\n".join([BEGIN, *table(["measured", "model", "device", "result", "file"], out), END])


# -- files -----------------------------------------------------------------------------------


def _readme_with(text: str, headline: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + headline + text[end:]


def stale(root: Path) -> list[str]:
    """The generated files under ``root`` that differ from what its records give, and the plots
    docs/benchmarks.md cites that are missing (empty: up to date)."""
    records = load(root / "bench" / "results", root)
    markdown, plots = benchmarks_markdown(records)
    problems = []
    readme = (root / README).read_text()
    if BEGIN not in readme or END not in readme:
        problems.append(f"{README}: no {BEGIN} ... {END} markers")
    elif _readme_with(readme, headline_markdown(records)) != readme:
        problems.append(f"{README}: the headline table is stale")
    docs = root / BENCHMARKS_MD
    if not docs.exists() or docs.read_text() != markdown:
        problems.append(f"{BENCHMARKS_MD} is stale")
    problems += [f"{PLOTS / file} is missing" for file in sorted(plots) if not (root / PLOTS / file).exists()]
    return problems


def write(root: Path) -> list[Path]:
    """Rewrite the README's table, docs/benchmarks.md and its plots (removing plots it no longer
    cites); returns the files written."""
    from bench.report_plots import draw

    records = load(root / "bench" / "results", root)
    markdown, plots = benchmarks_markdown(records)
    (root / BENCHMARKS_MD).write_text(markdown)
    readme = root / README
    readme.write_text(_readme_with(readme.read_text(), headline_markdown(records)))
    (root / PLOTS).mkdir(parents=True, exist_ok=True)
    for old in (root / PLOTS).glob("*.png"):
        if old.name not in plots:
            old.unlink()
    written = [readme, root / BENCHMARKS_MD]
    for file, (benchmark, row) in sorted(plots.items()):
        draw(benchmark, row, BENCHMARKS.get(benchmark, Benchmark("", "")).curve, root / PLOTS / file)
        written.append(root / PLOTS / file)
    return written


def main(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed tables are stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(root)
        for problem in problems:
            print(f"{problem}: run python -m bench.report", file=sys.stderr)
        return 1 if problems else 0
    for path in write(root):
        print(path.relative_to(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
