"""Quarantine records on the real Redis: one gateway's quarantine reaches another at its next
refresh, lives ``quarantine_s`` by Redis' own expiry, and is followed by probation as long; without
Redis the gateway's memory holds it for as long."""

from __future__ import annotations

import asyncio

from cluster.registry import ClusterNamespace, redis_client
from gateway import metrics
from gateway.quarantine import Quarantine
from tests.helpers.gateway import Clock


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
