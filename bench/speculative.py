"""Speculative decoding on the real model: tokens per second with and without it, exactness and
acceptance, on the input-grounded chats of ``bench/data/speculative.json`` (summarise or answer
from a passage, edit a code file, extract fields, multi-turn chat about an earlier message).

For each method (``ngram``, ``suffix``; ``--num-speculative-tokens`` drafts a step, default 3:
on the CPU the GGUF weights' int4 matmul costs about 1.5x a one-token step up to four tokens a
sequence and 2.8x at five) and for no speculation, fresh engines on SmolLM2-135M-Instruct (the
default model: on the CPU its GGUF weights as they are, on CUDA dequantized to bfloat16), greedy,
``--max-tokens`` new tokens (:func:`measure` says how the engines take turns):

- one stream: the first ``--prompts`` chats one after the other, each alone in the engine;
- ``N`` streams (``--streams``): ``N`` chats at once (the data's chats, repeated in order when
  ``N`` is larger), in one batch.

Per method and stream count the record holds the speedup (its tokens per second over no
speculation's), ``greedy_equal_fraction`` (answers equal to no speculation's, token for token),
the draft tokens' ``acceptance_rate`` and the ``mean_accepted_length`` (tokens a verification
yields: accepted drafts plus the target's one), from the engine's own counters; the one-stream
run's acceptance is also the record's unsuffixed-by-streams ``acceptance_rate_<method>`` and
``mean_accepted_length_<method>``. Each engine first answers one unrelated chat (warm-up, not
timed). With ``--disable-by-batch-size`` the
speculating engines turn speculation off above that many running sequences.

Prints the JSON record and writes it under ``bench/results/speculative/``. Usage:
``python -m bench.speculative [--device cpu|cuda] [--prompts 16] [--max-tokens 128] [--streams 16[,64]]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from bench.common import gpu_tag, machine, release_engine_memory, write_result
from engine import LLM, SamplingParams
from engine.model_source import default_gguf_path

DATA = Path(__file__).resolve().parent / "data" / "speculative.json"
METHODS = ("ngram", "suffix")
WARMUP = [{"role": "user", "content": "Say hello."}]


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    """(verifications, draft tokens, accepted tokens) so far; zeros without speculation."""
    spec = llm.engine.stats().spec_decoding
    return (0, 0, 0) if spec is None else (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)


def measure(device: str, methods: list[str], k: int, chats: list[list[dict]], max_tokens: int, streams: int,
            disable_by_batch_size: int | None) -> tuple[dict[str | None, dict], dict]:
    """Per method (``None``: no speculation): the answers, tokens per second and acceptance;
    and the engines' device, quantization and dtype.

    Fresh engines, one per method, alive together, over the same requests (one chat at a time,
    or all ``chats`` at once); no run's prefix cache or suffix tree helps another's. On the CPU
    they take turns, one step each, and an engine's time is the sum of its own steps, so a busy
    host's slow and fast moments fall on all of them alike; on CUDA (whose steps overlap the
    host's work under async scheduling) each engine runs the requests through alone in turn."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    memory = {"gpu_memory_utilization": 0.8 / (1 + len(methods))} if device.startswith("cuda") else {}
    llms = {}
    for method in (None, *methods):
        spec = None if method is None else {"method": method, "num_speculative_tokens": k,
                                            "disable_by_batch_size": disable_by_batch_size}
        llm = llms[method] = LLM(device=device, max_num_seqs=max(64, streams), speculative_config=spec, **memory)
        llm.chat(WARMUP, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    before = {m: _spec_counts(llm) for m, llm in llms.items()}
    prompts = [llms[None].engine.tokenizer.apply_chat_template(chat) for chat in chats]
    answers: dict[str | None, dict[str, list[int]]] = {m: {} for m in llms}
    seconds = dict.fromkeys(llms, 0.0)
    for batch in ([[i] for i in range(len(prompts))] if streams == 1 else [list(range(len(prompts)))]):
        for group in ([llms] if device == "cpu" else [{m: llm} for m, llm in llms.items()]):
            for llm in group.values():
                for i in batch:
                    llm.engine.add_request(f"chat-{i}", prompts[i], params)
            while any(llm.engine.has_unfinished_requests for llm in group.values()):
                for method, llm in group.items():
                    if not llm.engine.has_unfinished_requests:
                        continue
                    started = time.perf_counter()
                    outputs = llm.engine.step().outputs
                    seconds[method] += time.perf_counter() - started
                    answers[method].update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
    runs = {}
    for method, llm in llms.items():
        drafts, draft_tokens, accepted = (a - b for a, b in zip(_spec_counts(llm), before[method]))
        ordered = [answers[method][f"chat-{i}"] for i in range(len(prompts))]
        runs[method] = {"answers": ordered, "tok_s": sum(map(len, ordered)) / seconds[method],
                        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0}
    engine = llms[None].engine
    info = {"device": str(engine.device), "quantization": engine.quantization,
            "dtype": str(engine.dtype).removeprefix("torch.")}
    del llms, llm, engine
    release_engine_memory()
    return runs, info


def _name(device_type: str, streams: int) -> str:
    if device_type == "cpu":
        return "cpu_one_stream" if streams == 1 else f"cpu_batch{streams}"
    return f"gpu_batch{streams}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--prompts", type=int, default=16, help="chats of the one-stream run")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--streams", default="16", help="concurrent streams of the batched runs, comma-separated")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    chats = [item["messages"] for item in data]
    device_type = torch.device(args.device).type
    methods = [m for m in args.methods.split(",") if m]
    metrics = {}
    equal, total = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    streams_list = [int(n) for n in args.streams.split(",") if n]
    for streams in [1, *streams_list]:
        batch = chats[:args.prompts] if streams == 1 else list(itertools.islice(itertools.cycle(chats), streams))
        runs, info = measure(args.device, methods, args.num_speculative_tokens, batch, args.max_tokens, streams,
                       args.disable_by_batch_size)
        name = _name(device_type, streams)
        metrics[f"{name}_tok_s_plain"] = runs[None]["tok_s"]
        for method in methods:
            run = runs[method]
            metrics[f"{name}_tok_s_{method}"] = run["tok_s"]
            metrics[f"{name}_speedup_{method}"] = run["tok_s"] / runs[None]["tok_s"]
            metrics[f"{name}_acceptance_rate_{method}"] = run["acceptance_rate"]
            metrics[f"{name}_mean_accepted_length_{method}"] = run["mean_accepted_length"]
            if streams == 1:
                metrics[f"acceptance_rate_{method}"] = run["acceptance_rate"]
                metrics[f"mean_accepted_length_{method}"] = run["mean_accepted_length"]
            equal[method] += sum(a == b for a, b in zip(run["answers"], runs[None]["answers"]))
            total[method] += len(run["answers"])
    for method in methods:
        metrics[f"greedy_equal_fraction_{method}"] = equal[method] / total[method]
    workload = {"data": str(DATA.relative_to(DATA.parents[2])), "one_stream_prompts": min(args.prompts, len(chats)),
                "streams": streams_list, "max_tokens": args.max_tokens, "greedy": True, **info,
                "num_speculative_tokens": args.num_speculative_tokens,
                "disable_by_batch_size": args.disable_by_batch_size, "methods": methods,
                "threads": torch.get_num_threads() if device_type == "cpu" else None}
    if device_type == "cuda":
        name = torch.cuda.get_device_name(info["device"])
        write_result("speculative", metrics, workload, tag=gpu_tag(name), model=default_gguf_path().name, gpu=name)
    else:
        write_result("speculative", metrics, workload, model=default_gguf_path().name, machine=machine())


if __name__ == "__main__":
    main()
