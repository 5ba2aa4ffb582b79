"""The engine core in a process of its own (``EngineCoreClient.spawn``): the same tokens as the
engine in this process, the KV pool this process allocated is the one the core computes into,
a bad request fails alone, and a shutdown leaves no process and no shared file behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from engine import EngineConfig, EngineCore, SamplingParams
from engine.core import core_client
from engine.core.core_client import EngineCoreClient
from engine.runner.kv_cache import KVCache

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(device="cpu", num_blocks=32, block_size=16, max_num_batched_tokens=64)
PROMPTS = [list(range(5, 45)), list(range(200, 217))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def test_a_spawned_engine_core_computes_what_the_engine_in_this_process_does(monkeypatch):
    local = EngineCore("smollm2-135m", CONFIG, load_format="dummy")
    for i, prompt in enumerate(PROMPTS):
        local.add_request(f"r{i}", prompt, GREEDY)
    expected: dict[str, list[int]] = {}
    while local.has_unfinished_requests:
        expected |= {o.request_id: list(o.outputs[0].token_ids) for o in local.step().outputs if o.finished}
    handles = []

    def allocate_shared(*args):
        pool, handle = allocate(*args)
        handles.append(handle)
        return pool, handle

    allocate = core_client.allocate_shared
    monkeypatch.setattr(core_client, "allocate_shared", allocate_shared)

    async def main() -> None:
        engine = await EngineCoreClient.spawn("smollm2-135m", CONFIG, load_format="dummy")
        process = engine._process
        try:
            # Every process that maps the pool has: its file's name is gone (the memory stays).
            assert handles and not any(os.path.exists(h["path"]) for h in handles)
            assert engine.info.num_blocks == 32 and len(engine.kv_pools) == 1
            assert tuple(engine.kv_pools[0].shape) == KVCache.shape(local.model_config, 32, 16)
            free = await engine.num_free_blocks()

            async def run(request_id: str, prompt: list[int]) -> list[int]:
                outs = [list(o.outputs[0].token_ids) async for o in engine.generate(request_id, prompt, GREEDY)]
                return outs[-1]

            got = await asyncio.gather(*(run(f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert got == [expected["r0"], expected["r1"]]
            # The prompt's KV is in this process's pool: the core wrote it where this process reads.
            assert engine.kv_pools[0].abs().sum() > 0
            with pytest.raises(ValueError, match="prompt"):
                [o async for o in engine.generate("bad", [], GREEDY)]
            assert await engine.num_free_blocks() == free
        finally:
            await engine.shutdown()
        assert process.wait(timeout=30) == 0

    asyncio.run(main())
