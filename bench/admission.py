"""The engine thread's time to admit one long prefilled prompt: a decode worker's ``Admit``
(``reserve_blocks``) and its ``Decode`` joining the batch (``add_prefilled_request``).

That time passes between two steps of the decode worker's batch, so it delays every running
stream's next token: under long prefills it shows in the decode-heavy requests' ITL p99. Two
ways, alternated in this one process so their ratio holds on a busy machine:

- ``engine``: the engine hashes the prompt's blocks itself, in each call;
- ``handed``: the caller hashes them (``EngineCore.block_hashes``, timed apart: the engine core's client
  does it on its event loop, while a step runs) and hands them to both calls.

Workload: 4000-token prompts of random ids (seeded), 16-token blocks, each admitted, joined with
its first token and aborted, 200 per way after 20 of warm-up. The model's weights play no part
(``smollm2-135m``, random weights, on the CPU). Metrics: mean milliseconds of each call per way,
``hash_ms`` (the caller's hashing), and ``engine_thread_speedup`` (engine / handed, both calls).

Usage: ``python -m bench.admission [--prompt-tokens 4000] [--requests 200]``
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import machine, write_result
from bench.stats import mean
from engine import EngineConfig, EngineCore, SamplingParams

WARMUP = 20


def admit(engine: EngineCore, request_id: str, prompt: list[int], handed: bool) -> tuple[float, float, float]:
    """Reserve, join and abort one prompt; seconds spent hashing (caller), reserving, joining."""
    start = time.perf_counter()
    hashes = engine.block_hashes(prompt) if handed else None
    hashed = time.perf_counter()
    blocks, _ = engine.reserve_blocks(prompt, "", hashes)
    reserved = time.perf_counter()
    engine.add_prefilled_request(request_id, prompt, [1], SamplingParams(max_tokens=8), blocks, "", hashes)
    joined = time.perf_counter()
    engine.abort_request(request_id)
    return hashed - start, reserved - hashed, joined - reserved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    num_blocks = 2 * (args.prompt_tokens // 16 + 1)  # one request at a time, in 16-token blocks
    engine = EngineCore("smollm2-135m", EngineConfig(num_blocks=num_blocks, max_model_len=args.prompt_tokens + 64),
                       load_format="dummy")
    rng = random.Random(0)
    times: dict[str, list[tuple[float, float, float]]] = {"engine": [], "handed": []}
    for i in range(WARMUP + args.requests):
        for way in times:
            prompt = [rng.randrange(100, engine.vocab_size) for _ in range(args.prompt_tokens)]
            sample = admit(engine, f"{way}-{i}", prompt, way == "handed")
            if i >= WARMUP:
                times[way].append(sample)
    metrics = {}
    for way, samples in times.items():
        for name, column in zip(("hash", "reserve", "join"), zip(*samples)):
            metrics[f"{name}_ms_{way}"] = round(1e3 * mean(column), 4)
    del metrics["hash_ms_engine"]
    metrics["hash_ms"] = metrics.pop("hash_ms_handed")
    metrics["engine_thread_speedup"] = round(
        (metrics["reserve_ms_engine"] + metrics["join_ms_engine"])
        / (metrics["reserve_ms_handed"] + metrics["join_ms_handed"]), 3)
    write_result("admission", metrics, {"prompt_tokens": args.prompt_tokens, "block_size": engine.config.block_size,
                                        "requests_per_way": args.requests, "warmup": WARMUP},
                 model="smollm2-135m (random weights)", machine=machine())


if __name__ == "__main__":
    main()
