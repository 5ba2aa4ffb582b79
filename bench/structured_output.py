"""Structured output on the real model: answers under a JSON schema, with and without the
constraint, and what the constraint adds to the sampler's step.

- Validity: the 64 chat prompts of ``bench/data/structured_output.json``, each with its own JSON
  schema (objects of bounded strings, integers, numbers, booleans, enums and short arrays), the
  schema also written in the prompt, greedy, one batch on SmolLM2-135M-Instruct (the default
  model). Unconstrained, the answer counts as parsed when its text (a surrounding Markdown code
  fence dropped) is one JSON value, and as valid when ``jsonschema`` accepts that value under its
  schema; constrained (``structured_output.json_schema``), the same test on the raw text. A
  constrained answer cut by ``--max-tokens`` counts as invalid.
- Sampler time: the engine's own sampler (:func:`engine.runner.sampler.sample` with the logit
  processing of :mod:`engine.runner.logits_processors`) over batches of 1 and 64 of those
  sequences, on ``[batch, vocab]`` float32 logits on the device, the grammar matchers walking the
  constrained run's real answers (each step appends the next recorded token); per step, wall
  time with the device synchronized, constrained (bitmask fill, mask, sample, count) against
  unconstrained (sample), the median over the steps, with one intra-op thread on the CPU (a
  small op split over two threads of a busy 2-core host waits for the second core: 1000x slower
  than the op). Compile time: each schema's first compile.

Prints the JSON record and writes it under ``bench/results/structured_output/``. Usage:
``python -m bench.structured_output [--device cpu|cuda] [--prompts 64] [--max-tokens 128]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from bench.common import gpu_tag, machine, write_result
from engine import EngineConfig, EngineCore, SamplingParams
from engine.core.sequence import Sequence
from engine.model_source import default_gguf_path
from engine.outputs import CompletionOutput
from engine.runner.logits_processors import LogitsProcessors
from engine.runner.sampler import SamplingBatch, sample
from engine.sampling_params import StructuredOutput

DATA = Path(__file__).resolve().parent / "data" / "structured_output.json"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _prompt(item: dict) -> str:
    return f"{item['prompt']} Answer with one JSON object following this JSON schema: {json.dumps(item['schema'])}"


def _validity(text: str, schema: dict, unfence: bool) -> tuple[bool, bool]:
    """(parsed, valid) of one answer."""
    text = text.strip()
    if unfence and (match := _FENCE.match(text)):
        text = match.group(1)
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def _run(engine: EngineCore, items: list[dict], max_tokens: int, constrained: bool) -> list[CompletionOutput]:
    """Every item's greedy answer, all of them in one batch."""
    for i, item in enumerate(items):
        spec = StructuredOutput(json_schema=json.dumps(item["schema"])) if constrained else None
        chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": _prompt(item)}])
        engine.add_request(f"{constrained}-{i}", chat, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      structured_output=spec))
    done = {}
    while len(done) < len(items):
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"{constrained}-{i}"] for i in range(len(items))]


def validity(engine: EngineCore, items: list[dict], max_tokens: int) -> tuple[dict[str, float], list[list[int]]]:
    """The shares of answers that parse and validate, each way, and the constrained answers'
    tokens (for :func:`sampler_times`)."""
    metrics, answers = {}, []
    for constrained in (False, True):
        started = time.perf_counter()
        outputs = _run(engine, items, max_tokens, constrained)
        elapsed = time.perf_counter() - started
        name = "constrained" if constrained else "unconstrained"
        results = []
        for item, out in zip(items, outputs):
            tokens = [t for t in out.token_ids if t not in engine.eos_token_ids]
            parsed, valid = _validity(engine.tokenizer.decode(tokens), item["schema"], unfence=not constrained)
            if constrained:
                valid = valid and out.finish_reason == "stop"
            results.append((parsed, valid))
        metrics[f"{name}_parse_share"] = sum(p for p, _ in results) / len(items)
        metrics[f"{name}_valid_share"] = sum(v for _, v in results) / len(items)
        metrics[f"{name}_mean_output_tokens"] = statistics.mean(len(o.token_ids) for o in outputs)
        metrics[f"{name}_run_s"] = elapsed
        if constrained:
            answers = [list(o.token_ids) for o in outputs]
    return metrics, answers


def compile_ms(engine: EngineCore, items: list[dict]) -> float:
    """Mean milliseconds of a schema's first compile (a compiler of its own: nothing cached)."""
    from engine.runner.grammar import Grammars

    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    grammars.compile(StructuredOutput(json_object=True))  # the tokenizer's vocabulary read, once
    times = []
    for item in items:
        started = time.perf_counter()
        grammars.compile(StructuredOutput(json_schema=json.dumps(item["schema"])))
        times.append(time.perf_counter() - started)
    return statistics.mean(times) * 1e3


def sampler_times(engine: EngineCore, items: list[dict], answers: list[list[int]], batch: int,
                  device: torch.device) -> tuple[float, float, int]:
    """Median per-step milliseconds of the sampler, unconstrained and constrained, over ``batch``
    of the sequences (see the module docstring), and the number of steps timed."""
    chosen = list(range(batch))
    steps = min(len(answers[i]) for i in chosen) - 1
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": _prompt(items[i])}])
               for i in chosen]
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, engine.vocab_size, generator=gen, device=device) * 4
    timings = {}
    for constrained in (False, True):
        processors = LogitsProcessors(engine.vocab_size, device, sorted(engine.eos_token_ids), engine.grammars)
        seqs = []
        for i, prompt in zip(chosen, prompts):
            spec = StructuredOutput(json_schema=json.dumps(items[i]["schema"])) if constrained else None
            seqs.append(Sequence(f"t{i}", 0, list(prompt), len(prompt), SamplingParams(
                temperature=0, structured_output=spec), 0))
        processing = processors.batch(seqs)
        per_step = []
        for step in range(steps):
            positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64, device=device)
            sampling = SamplingBatch.from_sequences(seqs, positions, processing)
            _sync(device)
            started = time.perf_counter()
            bitmask = processors.fill_bitmask(processing) if processing is not None else None
            out = sample(logits.clone(), sampling, (1, 2), bitmask)
            if processing is not None:
                processors.record(processing, out.token_ids)
            _sync(device)
            per_step.append(time.perf_counter() - started)
            for s, i in zip(seqs, chosen):
                s.token_ids.append(answers[i][step])
        timings[constrained] = statistics.median(per_step) * 1e3
    return timings[False], timings[True], steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    items = json.loads(DATA.read_text())[:args.prompts]
    engine = EngineCore(None, EngineConfig(device=args.device, max_num_seqs=max(64, args.prompts)))
    device = engine.device
    metrics, answers = validity(engine, items, args.max_tokens)
    metrics["compile_ms_mean"] = compile_ms(engine, items)
    if device.type == "cpu":
        torch.set_num_threads(1)
    for batch in sorted({1, min(64, args.prompts)}):
        plain, constrained, steps = sampler_times(engine, items, answers, batch, device)
        metrics[f"sampler_ms_batch{batch}_unconstrained"] = plain
        metrics[f"sampler_ms_batch{batch}_constrained"] = constrained
        metrics[f"sampler_added_ms_batch{batch}"] = constrained - plain
        metrics[f"sampler_steps_batch{batch}"] = steps
    workload = {"prompts": len(items), "max_tokens": args.max_tokens, "greedy": True, "device": str(device),
                "data": str(DATA.relative_to(DATA.parents[2])), "quantization": engine.quantization,
                "async_scheduling": engine.async_scheduling,
                "sampler_threads": torch.get_num_threads() if device.type == "cpu" else None}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        write_result("structured_output", metrics, workload, tag=gpu_tag(name), model=default_gguf_path().name,
                     gpu=name)
    else:
        write_result("structured_output", metrics, workload, model=default_gguf_path().name, machine=machine())


if __name__ == "__main__":
    main()
