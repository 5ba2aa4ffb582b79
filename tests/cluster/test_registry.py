"""Worker registry against the real Redis: registration, load, expiry, the heartbeat task."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from engine.core.block_pool import BlockPool
from tests.helpers.worker_config import CONFIG
from cluster.prefix_index import PrefixIndex
from cluster.heartbeat import Heartbeat
from cluster.registry import (
    ClusterNamespace,
    Role,
    WorkerInfo,
    WorkerLoad,
    WorkerRegistry,
    redis_client,
)


def _ns(key_prefix: str, ttl_s: float = 3.0) -> ClusterNamespace:
    return ClusterNamespace(key_prefix, ttl_s=ttl_s)


def _worker(worker_id: str, role: Role = Role.PREFILL, **load: int) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"10.0.0.1:{50000 + len(worker_id)}", CONFIG, WorkerLoad(**load))


def test_heartbeat_registers_worker_with_its_load(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        p0 = _worker("p0", running=2, waiting=1, free_blocks=90, total_blocks=100)
        assert await registry.heartbeat(p0) is True  # first beat creates the registration
        assert await registry.heartbeat(_worker("p1")) is True
        assert await registry.heartbeat(_worker("d0", Role.DECODE, free_blocks=7, total_blocks=8)) is True

        assert await registry.live_workers(Role.PREFILL) == [p0, _worker("p1")]
        assert await registry.live_workers(Role.DECODE) == [_worker("d0", Role.DECODE, free_blocks=7, total_blocks=8)]

        tp = WorkerInfo("p2", Role.PREFILL, "p2:5000", dataclasses.replace(
            CONFIG, tensor_parallel_size=2, kv_transports=("nixl", "grpc"), quantization="gguf",
            max_num_batched_tokens=512, device_ids=("GPU-0d7c2a", "GPU-5e91b4")))
        await registry.heartbeat(tp)  # the KV layout and weights a worker publishes read back as written
        assert (await registry.live_workers(Role.PREFILL))[2] == tp
        lender = WorkerInfo("d1", Role.DECODE, "d1:5000", dataclasses.replace(CONFIG, serves_prefill=True))
        await registry.heartbeat(lender)  # a decode worker that also prefills for others says so
        assert [w.config.serves_prefill for w in await registry.live_workers(Role.DECODE)] == [False, True]

        busier = _worker("p0", running=5, waiting=3, free_blocks=10, total_blocks=100)
        assert await registry.heartbeat(busier) is False  # a refresh, not a new registration
        assert (await registry.live_workers(Role.PREFILL))[0].load == busier.load
        await client.aclose()

    asyncio.run(main())


def test_a_load_reads_back_with_its_age_by_redis_clock(key_prefix, redis_url):
    """The gateway adds what it routed after a load was measured: the age says when that was."""
    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix, ttl_s=3.0))
        await registry.heartbeat(_worker("p0", running=1))
        [fresh] = await registry.live_workers(Role.PREFILL)
        await asyncio.sleep(0.4)
        [older] = await registry.live_workers(Role.PREFILL)
        assert 0 <= fresh.load.age_s < 0.3 and 0.4 <= older.load.age_s < 3.0, (fresh.load, older.load)
        assert older.load.age_s - fresh.load.age_s >= 0.39
        await registry.heartbeat(_worker("p0", running=2))  # a beat measures the load anew
        [beaten] = await registry.live_workers(Role.PREFILL)
        assert beaten.load.running == 2 and beaten.load.age_s < older.load.age_s
        await client.aclose()

    asyncio.run(main())


def test_keys_are_namespaced(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        await WorkerRegistry(client, ns).heartbeat(_worker("p0"))
        keys = sorted([k.decode() async for k in client.scan_iter(match=f"tandem:{key_prefix}:*")])
        await client.aclose()
        return keys

    assert asyncio.run(main()) == [
        f"tandem:{key_prefix}:worker:p0",
        f"tandem:{key_prefix}:workers:prefill",
    ]


def test_dead_worker_expires_and_is_pruned(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix, ttl_s=0.5)
        registry = WorkerRegistry(client, ns)
        await registry.heartbeat(_worker("dead"))
        await registry.heartbeat(_worker("alive"))
        await asyncio.sleep(0.4)
        await registry.heartbeat(_worker("alive"))
        await asyncio.sleep(0.4)  # "dead" expired 0.3 s ago; "alive" keeps beating
        await registry.heartbeat(_worker("alive"))
        assert [w.worker_id for w in await registry.live_workers(Role.PREFILL)] == ["alive"]
        assert await client.smembers(ns.role_key(Role.PREFILL)) == {b"alive"}  # pruned on read
        await asyncio.sleep(0.7)
        assert await registry.live_workers(Role.PREFILL) == []
        assert await client.exists(ns.role_key(Role.PREFILL)) == 0  # the set expires with its last member
        await client.aclose()

    asyncio.run(main())


def test_unreadable_entry_is_skipped(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry = WorkerRegistry(client, ns)
        await registry.heartbeat(_worker("d0", Role.DECODE))
        await client.hset(ns.worker_key("old"), mapping={"worker_id": "old", "role": "decode"})  # no load
        await client.sadd(ns.role_key(Role.DECODE), "old")
        assert [w.worker_id for w in await registry.live_workers(Role.DECODE)] == ["d0"]
        await client.aclose()

    asyncio.run(main())


def test_deregister_removes_worker_at_once(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        await registry.heartbeat(_worker("d0", Role.DECODE))
        await registry.deregister("d0", Role.DECODE)
        assert await registry.live_workers(Role.DECODE) == []
        await client.aclose()

    asyncio.run(main())


def test_heartbeat_task_keeps_worker_alive_then_deregisters(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix, ttl_s=0.5)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        pool = BlockPool(8)
        load = {"running": 0}
        task = Heartbeat(registry, _worker("p0"), lambda: WorkerLoad(running=load["running"], total_blocks=8),
                         index=index, blocks=pool, interval_s=0.1)
        task.start()
        await asyncio.sleep(0.2)
        assert [w.worker_id for w in await registry.live_workers(Role.PREFILL)] == ["p0"]

        load["running"] = 3
        pool.cache(pool.allocate(1)[0], b"h" * 16)
        await asyncio.sleep(1.0)  # twice the TTL: alive only because it keeps beating
        [p0] = await registry.live_workers(Role.PREFILL)
        assert p0.load.running == 3
        assert await index.cached_runs(["p0"], [b"h" * 16]) == {"p0": 1}

        await task.stop()
        assert await registry.live_workers(Role.PREFILL) == []
        assert await client.exists(ns.blocks_key("p0")) == 0
        await client.aclose()

    asyncio.run(main())


def test_a_heartbeat_stopped_at_any_moment_ends_and_stays_deregistered(key_prefix, redis_url):
    """Stops landing at random points of a beat, connecting included: each returns and no beat
    re-registers the worker after it (on Python 3.11 redis-py's use of asyncio.wait_for drops
    some of these cancellations; the old loop then beat on and its stop never returned)."""

    async def main():
        rng = random.Random(0)
        for attempt in range(40):
            client = redis_client(redis_url)  # a fresh pool: the first beat also connects
            registry = WorkerRegistry(client, _ns(key_prefix, ttl_s=0.5))
            beat = Heartbeat(registry, _worker("p0"), WorkerLoad, interval_s=0.001)
            beat.start()
            for _ in range(rng.randrange(12)):
                await asyncio.sleep(0)
            async with asyncio.timeout(5):
                await beat.stop()
            await asyncio.sleep(0.01)  # ten intervals: a loop still running would have beaten again
            assert await registry.live_workers(Role.PREFILL) == []
            await client.aclose()

    asyncio.run(main())


def test_heartbeat_task_survives_a_failing_load_callback(key_prefix, redis_url):
    calls = {"n": 0}

    def flaky_load() -> WorkerLoad:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine not ready")
        return WorkerLoad(running=1)

    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix, ttl_s=0.5))
        task = Heartbeat(registry, _worker("d0", Role.DECODE), flaky_load, interval_s=0.05)
        task.start()
        await asyncio.sleep(0.3)
        assert [w.load.running for w in await registry.live_workers(Role.DECODE)] == [1]
        await task.stop()
        await client.aclose()

    asyncio.run(main())


def test_heartbeat_resyncs_the_index_when_redis_lost_the_workers_keys(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        pool = BlockPool(4)
        hashes = [bytes([i]) * 16 for i in range(3)]
        for block, h in zip(pool.allocate(3), hashes):
            pool.cache(block, h)
        task = Heartbeat(registry, _worker("p0"), WorkerLoad, index=index, blocks=pool, interval_s=0.5)
        await task.beat()
        assert await index.cached_runs(["p0"], hashes) == {"p0": 3}

        # What a Redis restart (or a TTL that ran out during an outage) looks like to the worker.
        await client.delete(ns.worker_key("p0"), ns.blocks_key("p0"), ns.role_key(Role.PREFILL))
        await task.beat()
        assert [w.worker_id for w in await registry.live_workers(Role.PREFILL)] == ["p0"]
        assert await index.cached_runs(["p0"], hashes) == {"p0": 3}
        await client.aclose()

    asyncio.run(main())


def test_invalid_configuration_is_rejected(key_prefix):
    with pytest.raises(ValueError, match="ttl_s"):
        ClusterNamespace(key_prefix, ttl_s=0)
    with pytest.raises(ValueError, match="key_prefix"):
        ClusterNamespace("", 3.0)
    with pytest.raises(ValueError, match="worker_id"):
        WorkerInfo("a:b", Role.DECODE, "x:1", CONFIG)
    registry = WorkerRegistry(redis_client("redis://127.0.0.1:6379/0"), _ns(key_prefix, ttl_s=1.0))
    with pytest.raises(ValueError, match="interval_s"):
        Heartbeat(registry, _worker("p0"), WorkerLoad, interval_s=1.0)
    with pytest.raises(ValueError, match="together"):
        Heartbeat(registry, _worker("p0"), WorkerLoad, blocks=BlockPool(1), interval_s=0.5)


def test_a_password_protected_redis_is_used_with_the_password_only(private_redis):
    import redis as redis_sync

    redis_sync.Redis.from_url(private_redis.url).config_set("requirepass", "s3cret")

    async def main():
        anonymous = redis_client(private_redis.url)
        with pytest.raises(redis_sync.exceptions.AuthenticationError):
            await WorkerRegistry(anonymous, _ns("pw")).heartbeat(_worker("p0"))
        await anonymous.aclose()
        client = redis_client(private_redis.url, password="s3cret")
        registry = WorkerRegistry(client, _ns("pw"))
        assert await registry.heartbeat(_worker("p0"))
        assert [w.worker_id for w in await registry.live_workers(Role.PREFILL)] == ["p0"]
        await client.aclose()

    asyncio.run(main())



@pytest.mark.parametrize("max_connections", [1, 4])
def test_a_burst_of_commands_shares_a_bounded_pool_of_connections(private_redis, max_connections):
    import redis as redis_sync

    async def main():
        client = redis_client(private_redis.url, max_connections=max_connections)
        replies = await asyncio.gather(*(client.echo(str(i)) for i in range(200)))  # all at once
        await client.aclose()
        return replies

    observer = redis_sync.Redis.from_url(private_redis.url)
    before = observer.info("stats")["total_connections_received"]
    assert asyncio.run(main()) == [str(i).encode() for i in range(200)]
    opened = observer.info("stats")["total_connections_received"] - before
    assert opened == max_connections, opened  # redis-py's default pool: 100, then the 101st command fails
    observer.close()
