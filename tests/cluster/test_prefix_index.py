"""Prefix index against the real Redis: longest cached runs, events, resync, expiry."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from engine.block_hash import hash_blocks, hash_seed
from engine.core.block_pool import BlockPool
from tests.helpers.worker_config import CONFIG
from cluster.prefix_index import PrefixIndex, leading_run, net_events
from cluster.heartbeat import Heartbeat
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client

BLOCK_SIZE = 4
H = hash_blocks(list(range(6 * BLOCK_SIZE)), BLOCK_SIZE, hash_seed("test/model", BLOCK_SIZE, "bfloat16"))


def _index(client, key_prefix: str, ttl_s: float = 3.0) -> PrefixIndex:
    return PrefixIndex(client, ClusterNamespace(key_prefix, ttl_s=ttl_s))


def test_run_is_the_leading_prefix_only(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix)
        await index.publish("gap", stored=[H[0], H[1], H[3]], removed=[])
        await index.publish("all", stored=H, removed=[])
        await index.publish("tail", stored=H[1:], removed=[])
        runs = await index.cached_runs(["gap", "all", "tail", "unknown"], H)
        assert runs == {"gap": 2, "all": 6, "tail": 0, "unknown": 0}
        assert await index.cached_runs(["gap"], []) == {"gap": 0}
        await client.aclose()

    asyncio.run(main())


def test_a_lookup_cancelled_at_any_point_ends_cancelled(key_prefix, redis_url):
    """A client cancelling while the gateway looks up its prompt's blocks stops the request there
    (on Python 3.11 redis-py's send dropped the cancellation of about one such lookup in two).
    The stages are the event-loop iterations a lookup takes here (4 to 7 seen), each in turn."""
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix)
        await index.publish("w", stored=H, removed=[])

        async def iterations() -> int:
            lookup, count = asyncio.ensure_future(index.cached_runs(["w", "v"], H)), 0
            while not lookup.done():
                await asyncio.sleep(0)
                count += 1
            await lookup
            return count

        stages = max(1, min([await iterations() for _ in range(5)]))
        cancelled = lost = 0
        for i in range(300):
            lookup = asyncio.ensure_future(index.cached_runs(["w", "v"], H))
            for _ in range(i % stages):  # cancel at every stage of the lookup in turn
                await asyncio.sleep(0)
            if not lookup.cancel():
                continue  # it had finished
            cancelled += 1
            try:
                await lookup
                lost += 1
            except asyncio.CancelledError:
                pass
        await client.aclose()
        assert cancelled >= 150 and lost == 0, (cancelled, lost)

    asyncio.run(main())


def test_removed_events_shorten_the_run(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix)
        await index.publish("p0", stored=H[:4], removed=[])
        await index.publish("p0", stored=[], removed=[H[2]])
        assert await index.cached_runs(["p0"], H) == {"p0": 2}
        await index.publish("p0", stored=[H[2]], removed=[H[1]])  # H2 recomputed, H1 evicted
        # One hash in both lists of a batch: its state before the batch decides.
        await index.publish("p0", stored=[H[1]], removed=[H[1]])  # stored, then evicted: gone
        await index.publish("p0", stored=[H[0]], removed=[H[0]])  # evicted, then recomputed: cached
        assert await index.cached_runs(["p0"], H) == {"p0": 1}
        await client.aclose()

    asyncio.run(main())


def test_resync_replaces_the_whole_set(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix)
        await index.publish("p0", stored=H[:3], removed=[])
        await index.resync("p0", [H[0], H[4]])
        assert await client.smembers(index.ns.blocks_key("p0")) == {H[0], H[4]}
        await index.resync("p0", [])
        assert await index.cached_runs(["p0"], H) == {"p0": 0}
        await client.aclose()

    asyncio.run(main())


def test_dead_workers_blocks_expire_with_it(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix, ttl_s=0.5)
        registry = WorkerRegistry(client, index.ns)
        pool = BlockPool(8)
        for block, h in zip(pool.allocate(3), H):
            pool.cache(block, h)
        alive = Heartbeat(registry, WorkerInfo("alive", Role.PREFILL, "a:1", CONFIG), WorkerLoad,
                          index=index, blocks=pool, interval_s=0.1)
        dead = Heartbeat(registry, WorkerInfo("dead", Role.PREFILL, "b:1", CONFIG), WorkerLoad,
                         index=index, blocks=pool, interval_s=0.1)
        await dead.beat()  # one beat, then silence: a crashed worker
        alive.start()
        await asyncio.sleep(0.2)
        assert await index.cached_runs(["alive", "dead"], H) == {"alive": 3, "dead": 3}
        await asyncio.sleep(0.6)
        assert await index.cached_runs(["alive", "dead"], H) == {"alive": 3, "dead": 0}
        assert await client.exists(index.ns.blocks_key("dead")) == 0
        await alive.stop()
        await client.aclose()

    asyncio.run(main())


def test_heartbeat_publishes_block_pool_events(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        index = _index(client, key_prefix)
        pool = BlockPool(3)
        task = Heartbeat(WorkerRegistry(client, index.ns), WorkerInfo("p0", Role.PREFILL, "a:1", CONFIG), WorkerLoad,
                         index=index, blocks=pool, interval_s=1.0)
        blocks = pool.allocate(3)
        for block, h in zip(blocks, H):
            pool.cache(block, h)
        await task.beat()  # first beat: a resync
        assert await index.cached_runs(["p0"], H) == {"p0": 3}

        pool.free(blocks[::-1])  # tail first: the prefix stays cached longest
        pool.cache(pool.allocate(1)[0], H[3])  # evicts H[2]'s block
        await task.beat()  # an incremental publish
        assert await client.smembers(index.ns.blocks_key("p0")) == {H[0], H[1], H[3]}
        assert await index.cached_runs(["p0"], H) == {"p0": 2}
        await client.aclose()

    asyncio.run(main())


@given(
    before=st.sets(st.integers(0, 7)),
    log=st.lists(st.integers(0, 7), max_size=40),
)
def test_net_events_apply_like_the_event_log(before, log):
    # Replay a pool's alternating events: touching a hash stores it if absent, removes it if cached.
    cached, stored, removed = set(before), [], []
    for h in log:
        if h in cached:
            cached.discard(h)
            removed.append(bytes([h]))
        else:
            cached.add(h)
            stored.append(bytes([h]))
    to_add, to_remove = net_events(stored, removed)
    after = ({bytes([h]) for h in before} - set(to_remove)) | set(to_add)
    assert after == {bytes([h]) for h in cached}


@given(st.lists(st.booleans()))
def test_leading_run_counts_leading_hits(flags):
    run = leading_run(flags)
    assert all(flags[:run]) and (run == len(flags) or not flags[run])
