"""What one engine step costs beside a running batch: a decode step, and a mixed step (the same
decode plus a prompt chunk), each as wall time and as the host time until its device work is
queued (``ModelRunner.launch`` returned; synchronous scheduling): with every CUDA graph
(``graphs``: decode graphs, and piecewise graphs for the mixed step), with decode graphs only
(``decode_graphs``: the mixed step eager, ``cuda_graph_token_sizes`` empty), and eagerly
(``eager``), one engine after another in one process.

Where the host's launches take longer than the device's work, an eager mixed step's cost is
its launches and not its tokens: this measures which, for the placement model's price of a
local prefill (:mod:`gateway.placement`), and what the piecewise graphs take off it. Steps are
timed one at a time, the device idle before each (a synchronize), the median of ``repeats``;
``*_launch_min_ms`` is the fastest launch of them, what the host does when nothing else takes
its cores (a shared host's eager steps move by 2x from one run to the next, and a comparison of
code versions reads this one).

Usage: ``python -m bench.step_overhead --model llama-3-8b --load-format dummy`` (on a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from bench.common import gpu_tag, machine, release_engine_memory, write_result
from bench.stats import median
from bench.throughput import make_prompts
from engine import LLM, SamplingParams

_PROMPT_TOKENS = 64  # each running sequence's prompt


def _timed_step(engine) -> tuple[float, float, int]:
    """One step's wall seconds, the host's seconds until its device work was queued, and the
    tokens it computed."""
    launched: list[float] = []
    launch = engine.runner.launch

    def timed_launch(step):
        pending = launch(step)
        launched.append(time.perf_counter())
        return pending

    engine.runner.launch = timed_launch
    try:
        start = time.perf_counter()
        output = engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        end = time.perf_counter()
    finally:
        del engine.runner.launch
    return end - start, (launched[0] if launched else end) - start, output.stats.num_tokens


def step_costs(llm: LLM, batch: int, chunk: int, repeats: int = 8, seed: int = 0) -> dict[str, float]:
    """Median ``decode_step_ms`` / ``decode_launch_ms`` (and the least, ``decode_launch_min_ms``)
    with ``batch`` sequences decoding, and ``mixed_*`` likewise with a ``chunk``-token prompt (one
    output token) added before each step; ``*_step_tokens``, the median tokens a step computed
    (``batch``, and ``batch + chunk``); the batch is aborted afterwards.

    The prompts are random tokens drawn with ``seed`` and ``seed + 1``: give each call of one
    engine seeds of its own, or the prefix cache serves a repeated prompt and the step computes a
    few of its tokens only.

    Raises:
        ValueError: ``chunk`` above the engine's step budget (the prompt would span steps).
    """
    engine = llm.engine
    if chunk + batch > engine.config.max_num_batched_tokens:
        raise ValueError(f"chunk={chunk} and batch={batch} exceed max_num_batched_tokens")
    running = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = make_prompts(batch, engine.vocab_size, (_PROMPT_TOKENS, _PROMPT_TOKENS), seed)
    chunks = make_prompts(repeats, engine.vocab_size, (chunk, chunk), seed + 1)
    ids = [f"run-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, running)
    for _ in range(4):  # past the batch's prefill, into steady decode
        engine.step()
    metrics = {}
    for kind in ("decode", "mixed"):
        walls, hosts, computed = [], [], []
        for r in range(repeats):
            if kind == "mixed":
                engine.add_request(f"chunk-{r}", chunks[r], one)
            wall, host, num_tokens = _timed_step(engine)
            walls.append(wall)
            hosts.append(host)
            computed.append(num_tokens)
        metrics[f"{kind}_step_ms"] = round(1e3 * median(walls), 3)
        metrics[f"{kind}_launch_ms"] = round(1e3 * median(hosts), 3)
        metrics[f"{kind}_launch_min_ms"] = round(1e3 * min(hosts), 3)
        metrics[f"{kind}_step_tokens"] = median(computed)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests:
        engine.step()
    return metrics


# Setup -> the engine settings that make it.
SETUPS = {
    "graphs": {},
    "decode_graphs": {"cuda_graph_token_sizes": []},
    "eager": {"enforce_eager": True},
}


def step_overhead(model: str, load_format: str, batches: tuple[int, ...], chunks: tuple[int, ...],
                  repeats: int, max_num_batched_tokens: int) -> dict[str, float]:
    """:func:`step_costs` for every batch and chunk, keys prefixed ``{setup}_b{batch}_c{chunk}_``
    (:data:`SETUPS`); on a CPU (no CUDA graphs) the eager engine only."""
    metrics = {}
    for setup in SETUPS if torch.cuda.is_available() else ("eager",):
        # One step per call, each measured alone: no step launched ahead of the one timed.
        llm = LLM(model, load_format=load_format, max_num_batched_tokens=max_num_batched_tokens, async_scheduling=False,
                  **SETUPS[setup])
        for i, (batch, chunk) in enumerate(itertools.product(batches, chunks)):
            prefix = f"{setup}_b{batch}_c{chunk}_"
            metrics |= {prefix + k: v for k, v in step_costs(llm, batch, chunk, repeats, seed=2 * i).items()}
        del llm
        release_engine_memory()
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batches", default="1,64", help="running sequences, comma-separated")
    parser.add_argument("--chunks", default="128,1024", help="prompt tokens of the mixed step, comma-separated")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    chunks = tuple(int(c) for c in args.chunks.split(","))
    metrics = step_overhead(args.model, args.load_format, batches, chunks, args.repeats, args.max_num_batched_tokens)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    keys = {"gpu": gpu} if gpu else {"machine": machine()}
    write_result("step_overhead", metrics, {"batches": batches, "chunks": chunks, "repeats": args.repeats,
                                            "prompt_tokens": _PROMPT_TOKENS,
                                            "max_num_batched_tokens": args.max_num_batched_tokens},
                 tag=gpu_tag(gpu) if gpu else "cpu", model=args.model, **keys)


if __name__ == "__main__":
    main()
