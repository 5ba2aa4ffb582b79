"""Quarantine records on the real Redis: one gateway's quarantine reaches another at its next
refresh, lives ``quarantine_s`` by Redis' own expiry, and is followed by probation as long; without
Redis the gateway's memory holds it for as long; a quarantined prefill worker gets no prompt from
any gateway."""

from __future__ import annotations

import asyncio
import random

from cluster.prefix_index import PrefixIndex
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from engine.block_hash import hash_blocks
from gateway import metrics
from gateway.outlier import OutlierDetector
from gateway.quarantine import Quarantine
from gateway.router import ClusterView
from tests.helpers.gateway import Clock
from tests.helpers.worker_config import CONFIG


def test_a_quarantine_reaches_every_gateway_and_ends_by_redis_expiry(redis_url, key_prefix):
    async def main():
        ns = ClusterNamespace(key_prefix, 3.0)
        ours, theirs = redis_client(redis_url), redis_client(redis_url)
        writer, reader = Quarantine(ours, ns, quarantine_s=0.5), Quarantine(theirs, ns, quarantine_s=0.5)
        try:
            await writer.add("prefill-7", "decode worker decode-0: kv spot check: prompt block 3 differs")
            assert writer.quarantined("prefill-7") and not reader.quarantined("prefill-7")
            ttl_ms = await ours.pttl(writer.record_key("prefill-7"))
            assert 0 < ttl_ms <= 500
            await reader.refresh()
            assert reader.active() == {"prefill-7": "decode worker decode-0: kv spot check: prompt block 3 differs"}
            assert reader.on_probation("prefill-7") and metrics.QUARANTINED_WORKERS._value.get() == 1
            await asyncio.sleep(0.6)
            await reader.refresh()
            assert not reader.quarantined("prefill-7") and reader.on_probation("prefill-7")
            assert not await ours.sismember(writer.set_key, "prefill-7")  # pruned with its record
        finally:
            await ours.aclose()
            await theirs.aclose()

    asyncio.run(main())


def test_without_redis_the_gateway_remembers_a_quarantine_then_a_probation():
    clock = Clock()
    book = Quarantine(None, ClusterNamespace("static", 3.0), quarantine_s=60, clock=clock)

    async def main():
        await book.add("prefill-127.0.0.1_5000", "a reason")
        await book.refresh()
        assert book.quarantined("prefill-127.0.0.1_5000")
        clock.now += 61
        await book.refresh()
        assert not book.quarantined("prefill-127.0.0.1_5000") and book.on_probation("prefill-127.0.0.1_5000")
        clock.now += 60
        await book.refresh()
        assert not book.on_probation("prefill-127.0.0.1_5000")

    asyncio.run(main())


def test_no_gateway_routes_a_prompt_to_a_worker_another_gateway_quarantined(redis_url, key_prefix):
    """Two gateways' views of one registry: the first quarantines a prefill worker; the second,
    at its next refresh, prefills on the other one only (and lends to no quarantined worker)."""
    async def main():
        ns = ClusterNamespace(key_prefix, 30.0)
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, ns)
        for worker_id, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
            await registry.heartbeat(WorkerInfo(worker_id, role, f"{worker_id}:5000", CONFIG,
                                                WorkerLoad(free_blocks=100, total_blocks=100)))
        first, second = (ClusterView(registry, PrefixIndex(client, ns), CONFIG.model_id,
                                     outliers=OutlierDetector(2, 5.0, 60.0), rng=random.Random(seed),
                                     quarantine=Quarantine(client, ns, quarantine_s=30)) for seed in (0, 1))
        try:
            await first.quarantine.add("p0", "decode worker d0: kv spot check: prompt block 1 differs")
            await second.refresh()
            prompt = list(range(4 * CONFIG.block_size + 1))
            hashes = hash_blocks(prompt, CONFIG.block_size, CONFIG.hash_seed)
            for _ in range(8):
                route = await second.choose(hashes, len(prompt))
                assert route.prefill.worker_id == "p1"
                second.prefill_done(route)
                second.decode_done(route)
            assert second.quarantine.on_probation("p0") and not second.quarantine.on_probation("p1")
        finally:
            await client.aclose()

    asyncio.run(main())
