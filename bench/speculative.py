"""Speculative decoding on the real model: tokens per second with and without it, exactness and
acceptance, on the input-grounded chats of ``bench/data/speculative.json`` (summarise or answer
from a passage, edit a code file, extract fields, multi-turn chat about an earlier message).

For each method (``ngram``, ``suffix``, and the ``draft_model`` method with two drafts:
``draft_self``, the target as its own draft, whose drafts are nearly all accepted, and
``draft_random``, a random-weight two-layer model of the target's shape otherwise, whose drafts
nearly never are; ``--num-speculative-tokens`` drafts a step, default 3:
on the CPU the GGUF weights' int4 matmul costs about 1.5x a one-token step up to four tokens a
sequence and 2.8x at five) and for no speculation, fresh engines on SmolLM2-135M-Instruct (the
default model: on the CPU its GGUF weights as they are, on CUDA dequantized to bfloat16), greedy,
``--max-tokens`` new tokens (:func:`measure` says how the engines take turns):

- one stream: the first ``--prompts`` chats one after the other, each alone in the engine;
- ``N`` streams (``--streams``): ``N`` chats at once (the data's chats, repeated in order when
  ``N`` is larger), in one batch.

Per method and stream count the record holds the speedup (its tokens per second over no
speculation's), ``greedy_equal_fraction`` (answers equal to no speculation's, token for token)
and ``greedy_unequal_max_gap`` (over the unequal ones, the largest log-probability gap of the two
likeliest tokens where they part: :func:`disagreement_gaps`),
the draft tokens' ``acceptance_rate`` and the ``mean_accepted_length`` (tokens a verification
yields: accepted drafts plus the target's one), from the engine's own counters; the one-stream
run's acceptance is also the record's unsuffixed-by-streams ``acceptance_rate_<method>`` and
``mean_accepted_length_<method>``. ``<name>_ms_per_step_<method>`` is an engine's time per step
and, for a draft model, ``<name>_draft_ms_per_step_<method>`` the part of it the draft's
proposals took (its overhead; draft_random's steps are a verification that yields one token
plus that overhead). Each engine first answers one unrelated chat (warm-up, not
timed). With ``--disable-by-batch-size`` the
speculating engines turn speculation off above that many running sequences. With ``--batch-invariant`` (CUDA) every engine
is batch-invariant (``EngineConfig.batch_invariant``): a verification's rows then round as plain
decoding's, so bfloat16's answers are exact too.

On the CPU with ``--vllm-python`` (vLLM's CPU build's virtual environment's Python), vLLM runs
the one-stream chats too, without speculation and with its ``ngram`` method of the same ``k``
(:mod:`bench.peer_vllm`), on the model's weights dequantized to bfloat16 (an HF checkpoint
written once under ``~/.cache/tandem``: vLLM does not read this GGUF); the record holds its
tokens per second, its own speedup and Tandem's ratio to it (``cpu_one_stream_ratio_to_vllm_<ngram|plain>``).

Prints the JSON record and writes it under ``bench/results/speculative/``. Usage:
``python -m bench.speculative [--device cpu|cuda] [--prompts 16] [--max-tokens 128] [--streams 16[,64]]
[--batch-invariant] [--vllm-python PATH]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import gpu_tag, machine, release_engine_memory, write_result
from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.layers.quantized import GroupQuantized
from engine.loading.gguf_tensors import read_gguf
from engine.loading.presets import PRESETS
from engine.model_source import TENSOR_TABLE, cache_root, default_gguf_path, resolve_model

DATA = Path(__file__).resolve().parent / "data" / "speculative.json"
METHODS = ("ngram", "suffix")
# The draft_model method's drafts by bench name: the target itself, and random weights of a
# two-layer model of its shape and vocabulary.
DRAFTS = {"draft_self": lambda: str(default_gguf_path()),
          "draft_random": lambda: {**PRESETS["smollm2-135m"], "num_hidden_layers": 2}}
WARMUP = [{"role": "user", "content": "Say hello."}]


def _spec_counts(llm: LLM) -> tuple[int, int, int]:
    """(verifications, draft tokens, accepted tokens) so far; zeros without speculation."""
    spec = llm.engine.stats().spec_decoding
    return (0, 0, 0) if spec is None else (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)


def measure(device: str, methods: list[str], spec: dict, chats: list[list[dict]], max_tokens: int, streams: int,
            batch_invariant: bool = False) -> tuple[dict[str | None, dict], dict]:
    """Per method (``None``: no speculation): the answers, tokens per second and acceptance;
    and the engines' device, quantization and dtype. ``spec`` holds the ``SpeculativeConfig``
    fields every method shares (``num_speculative_tokens``, ``disable_by_batch_size``, ...).

    Fresh engines, one per method, alive together, over the same requests (one chat at a time,
    or all ``chats`` at once); no run's prefix cache or suffix tree helps another's. On the CPU
    they take turns, one step each, and an engine's time is the sum of its own steps, so a busy
    host's slow and fast moments fall on all of them alike; on CUDA (whose steps overlap the
    host's work under async scheduling) each engine runs the requests through alone in turn."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    memory = {"gpu_memory_utilization": 0.8 / (1 + len(methods))} if device.startswith("cuda") else {}
    llms, draft_seconds = {}, {}
    for method in (None, *methods):
        llm = llms[method] = LLM(device=device, max_num_seqs=max(64, streams), batch_invariant=batch_invariant,
                                 speculative_config=_spec_config(method, spec), **memory)
        llm.chat(WARMUP, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        if method in DRAFTS:
            _time_proposals(llm.engine.proposer, draft_seconds, method)
    before = {m: _spec_counts(llm) for m, llm in llms.items()}
    draft_seconds.update(dict.fromkeys(draft_seconds, 0.0))
    prompts = [llms[None].engine.tokenizer.apply_chat_template(chat) for chat in chats]
    answers: dict[str | None, dict[str, list[int]]] = {m: {} for m in llms}
    seconds, steps = dict.fromkeys(llms, 0.0), dict.fromkeys(llms, 0)
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
                    steps[method] += 1
                    answers[method].update((o.request_id, o.outputs[0].token_ids) for o in outputs if o.finished)
    runs = {}
    for method, llm in llms.items():
        drafts, draft_tokens, accepted = (a - b for a, b in zip(_spec_counts(llm), before[method]))
        ordered = [answers[method][f"chat-{i}"] for i in range(len(prompts))]
        runs[method] = {"answers": ordered, "tok_s": sum(map(len, ordered)) / seconds[method],
                        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
                        "ms_per_step": 1000 * seconds[method] / steps[method]}
        if method in draft_seconds:
            runs[method]["draft_ms_per_step"] = 1000 * draft_seconds[method] / steps[method]
    plain = runs[None]["answers"]
    for method in methods:
        runs[method]["gaps"] = disagreement_gaps(llms[None], prompts, plain, runs[method]["answers"])
    engine = llms[None].engine
    info = {"device": str(engine.device), "quantization": engine.quantization,
            "dtype": str(engine.dtype).removeprefix("torch.")}
    del llms, llm, engine
    release_engine_memory()
    return runs, info


def _spec_config(method: str | None, spec: dict) -> dict | None:
    """The engine's ``speculative_config`` for a bench method (``None``: no speculation) with
    the shared fields ``spec``."""
    if method is None:
        return None
    if method in DRAFTS:
        return {**spec, "method": "draft_model", "model": DRAFTS[method]()}
    return {**spec, "method": method}


def _time_proposals(proposer, seconds: dict[str, float], method: str) -> None:
    """Add the time each of ``proposer``'s proposals takes to ``seconds[method]`` (on CUDA up
    to the drafts' copy to the host, which ends every proposal)."""
    propose = proposer.propose
    seconds[method] = 0.0

    def timed(seqs, num_tokens):
        started = time.perf_counter()
        drafts = propose(seqs, num_tokens)
        seconds[method] += time.perf_counter() - started
        return drafts

    proposer.propose = timed


def disagreement_gaps(llm: LLM, prompts: list[str], plain: list[list[int]], answers: list[list[int]]) -> list[float]:
    """For each answer unequal to plain decoding's, the gap (nats) between the two most likely
    tokens' log-probabilities, by ``llm`` without speculation, at the first position where the two
    answers part (a near-tie, which rounding flips, has a small gap). Not timed."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=2)
    gaps = []
    for prompt, want, got in zip(prompts, plain, answers):
        if want == got:
            continue
        i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        out = llm.generate([llm.engine.tokenize(prompt) + want[:i]], params, use_tqdm=False)[0].outputs[0]
        top = sorted(out.logprobs[0].values(), reverse=True)
        gaps.append(top[0] - top[1])
    return gaps


def hf_checkpoint() -> Path:
    """The default model as an HF checkpoint (config, tokenizer, ``model.safetensors`` of its
    weights dequantized to bfloat16), written once beside its converted GGUF directory."""
    from safetensors.torch import save_file
    source = resolve_model(None)
    out = cache_root() / f"{source.path.name}-bf16"
    if (out / "model.safetensors").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    for file in source.path.iterdir():
        if file.name != TENSOR_TABLE:
            shutil.copy(file, tmp / file.name)
    tensors = read_gguf(source.gguf, source.gguf_tensor_table()).tensors
    save_file({name: (t.dequantize() if isinstance(t, GroupQuantized) else t).to(torch.bfloat16).contiguous()
               for name, t in tensors.items()}, tmp / "model.safetensors")
    tmp.rename(out)
    return out


def measure_vllm(python: str, chats: list[list[dict]], max_tokens: int, k: int) -> dict[str, float]:
    """vLLM's one-stream tokens per second over ``chats`` without speculation (``plain``) and
    with its n-gram method of ``k`` drafts (``ngram``), each in a child process of ``python``
    (:mod:`bench.peer_vllm`)."""
    model = hf_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        data, out = Path(tmp) / "chats.json", Path(tmp) / "out.json"
        data.write_text(json.dumps(chats))
        runs = {}
        for name, ngram in (("plain", 0), ("ngram", k)):
            subprocess.run([python, "-I", str(Path(__file__).with_name("peer_vllm.py")), str(model), str(data),
                            "--out", str(out), "--max-tokens", str(max_tokens), "--ngram", str(ngram)],
                           capture_output=True, check=True)
            runs[name] = json.loads(out.read_text())["tok_s"]
    return runs


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
    parser.add_argument("--prompt-lookup-min", type=int, default=None,
                        help="ngram: the shortest n-gram matched (default: SpeculativeConfig's)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="CUDA: every engine batch-invariant (EngineConfig.batch_invariant): bf16 answers exact")
    parser.add_argument("--vllm-python", default=os.environ.get("TANDEM_VLLM_PYTHON", ""),
                        help="CPU: the Python of vLLM's CPU build's environment, to run it beside "
                             "(default: $TANDEM_VLLM_PYTHON; unset: vLLM does not run)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {', '.join([*METHODS, *DRAFTS])}")
    args = parser.parse_args()
    data = json.loads(DATA.read_text())
    chats = [item["messages"] for item in data]
    device_type = torch.device(args.device).type
    methods = [m for m in args.methods.split(",") if m]
    metrics = {}
    equal, total = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    gaps: dict[str, list[float]] = {m: [] for m in methods}
    streams_list = [int(n) for n in args.streams.split(",") if n]
    spec = {"num_speculative_tokens": args.num_speculative_tokens, "disable_by_batch_size": args.disable_by_batch_size}
    if args.prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = args.prompt_lookup_min
    for streams in [1, *streams_list]:
        batch = chats[:args.prompts] if streams == 1 else list(itertools.islice(itertools.cycle(chats), streams))
        runs, info = measure(args.device, methods, spec, batch, args.max_tokens, streams, args.batch_invariant)
        name = _name(device_type, streams)
        metrics[f"{name}_tok_s_plain"] = runs[None]["tok_s"]
        metrics[f"{name}_ms_per_step_plain"] = runs[None]["ms_per_step"]
        for method in methods:
            run = runs[method]
            metrics[f"{name}_tok_s_{method}"] = run["tok_s"]
            metrics[f"{name}_speedup_{method}"] = run["tok_s"] / runs[None]["tok_s"]
            metrics[f"{name}_acceptance_rate_{method}"] = run["acceptance_rate"]
            metrics[f"{name}_mean_accepted_length_{method}"] = run["mean_accepted_length"]
            metrics[f"{name}_ms_per_step_{method}"] = run["ms_per_step"]
            if "draft_ms_per_step" in run:
                metrics[f"{name}_draft_ms_per_step_{method}"] = run["draft_ms_per_step"]
            if streams == 1:
                metrics[f"acceptance_rate_{method}"] = run["acceptance_rate"]
                metrics[f"mean_accepted_length_{method}"] = run["mean_accepted_length"]
            equal[method] += sum(a == b for a, b in zip(run["answers"], runs[None]["answers"]))
            gaps[method] += run["gaps"]
            total[method] += len(run["answers"])
    for method in methods:
        metrics[f"greedy_equal_fraction_{method}"] = equal[method] / total[method]
        metrics[f"greedy_unequal_max_gap_{method}"] = max(gaps[method], default=0.0)
    if args.vllm_python and device_type == "cpu":
        vllm = measure_vllm(args.vllm_python, chats[:args.prompts], args.max_tokens, args.num_speculative_tokens)
        metrics["vllm_cpu_one_stream_tok_s_plain"] = vllm["plain"]
        metrics["vllm_cpu_one_stream_tok_s_ngram"] = vllm["ngram"]
        metrics["vllm_cpu_one_stream_speedup_ngram"] = vllm["ngram"] / vllm["plain"]
        metrics["cpu_one_stream_ratio_to_vllm_plain"] = metrics["cpu_one_stream_tok_s_plain"] / vllm["plain"]
        if "ngram" in methods:
            metrics["cpu_one_stream_ratio_to_vllm_ngram"] = metrics["cpu_one_stream_tok_s_ngram"] / vllm["ngram"]
    workload = {"data": str(DATA.relative_to(DATA.parents[2])), "one_stream_prompts": min(args.prompts, len(chats)),
                "streams": streams_list, "max_tokens": args.max_tokens, "greedy": True, **info,
                "num_speculative_tokens": args.num_speculative_tokens,
                "disable_by_batch_size": args.disable_by_batch_size, "methods": methods,
                "prompt_lookup_min": SpeculativeConfig(**spec).prompt_lookup_min,
                "batch_invariant": args.batch_invariant,
                "threads": torch.get_num_threads() if device_type == "cpu" else None}
    if device_type == "cuda":
        name = torch.cuda.get_device_name(info["device"])
        write_result("speculative", metrics, workload, tag=gpu_tag(name), model=default_gguf_path().name, gpu=name)
    else:
        write_result("speculative", metrics, workload, model=default_gguf_path().name, machine=machine())


if __name__ == "__main__":
    main()
