"""Routing: the pure picks (property-based) and ClusterView against real Redis, outage included."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import Counter

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from engine.block_hash import hash_blocks
from engine.core.block_pool import BlockPool
from tests.helpers.worker_config import BLOCK_SIZE, CONFIG
from cluster.prefix_index import PrefixIndex
from cluster.heartbeat import Heartbeat
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from gateway.outlier import OutlierDetector
from gateway.router import (
    ClusterView,
    NoCapacityError,
    NoWorkerError,
    RoutingPolicy,
    decode_score,
    pick_decode,
    pick_prefill,
    prefill_score,
)

PROMPT = list(range(6 * BLOCK_SIZE + 1))  # 6 full blocks and one partial: 7 blocks on decode
H = hash_blocks(PROMPT, BLOCK_SIZE, CONFIG.hash_seed)


def outliers() -> OutlierDetector:
    return OutlierDetector(consecutive_failures=2, base_ejection_s=5.0, max_ejection_s=60.0)

loads = st.builds(
    WorkerLoad,
    running=st.integers(0, 64),
    waiting=st.integers(0, 64),
    free_blocks=st.integers(0, 1000),
    total_blocks=st.just(1000),
)


def workers_of(role: Role, min_size: int = 0):
    return st.lists(loads, min_size=min_size, max_size=8).map(
        lambda ls: [WorkerInfo(f"{role.value[0]}{i}", role, f"10.0.0.{i}:5000", CONFIG, load) for i, load in enumerate(ls)]
    )


@given(workers=workers_of(Role.DECODE), prompt_blocks=st.integers(0, 1000), margin=st.integers(0, 8),
       seed=st.integers())
def test_chosen_decode_worker_has_room_and_best_score_then_least_load(workers, prompt_blocks, margin, seed):
    policy = RoutingPolicy(decode_margin_blocks=margin)
    chosen = pick_decode(workers, prompt_blocks, {}, BLOCK_SIZE, policy, random.Random(seed))
    fitting = [w for w in workers if w.load.free_blocks >= prompt_blocks + margin]
    if not fitting:
        assert chosen is None
    else:
        def score(w):
            return decode_score(0, w.load, BLOCK_SIZE, policy)

        best = [w for w in fitting if score(w) == max(map(score, fitting))]
        assert chosen in best
        assert chosen.load.num_seqs == min(w.load.num_seqs for w in best)


@pytest.mark.parametrize("extra_running, stays", [(4, True), (12, True), (40, False)])
def test_a_chats_next_turn_stays_with_its_decode_worker_unless_that_one_is_much_busier(extra_running, stays):
    """The previous turns (512 tokens) are cached on ``holder``; a running sequence costs
    ``decode_load_cost_tokens`` (32): the turn moves only past 16 more running sequences."""
    holder = WorkerInfo("holder", Role.DECODE, "10.0.0.1:5000", CONFIG,
                        WorkerLoad(running=64 + extra_running, free_blocks=1000, total_blocks=2000))
    other = WorkerInfo("other", Role.DECODE, "10.0.0.2:5000", CONFIG,
                       WorkerLoad(running=64, free_blocks=1000, total_blocks=2000))
    cached = 512 // BLOCK_SIZE
    chosen = pick_decode([holder, other], cached + 4, {"holder": cached}, BLOCK_SIZE, RoutingPolicy(), random.Random(0))
    assert chosen.worker_id == ("holder" if stays else "other")


@given(workers=workers_of(Role.PREFILL, min_size=1), runs=st.lists(st.integers(0, 64), min_size=8, max_size=8),
       cost=st.integers(0, 2048), seed=st.integers())
def test_chosen_prefill_worker_has_best_score_then_least_load(workers, runs, cost, seed):
    policy = RoutingPolicy(load_cost_tokens=cost)
    cached = {w.worker_id: run for w, run in zip(workers, runs)}
    chosen = pick_prefill(workers, cached, BLOCK_SIZE, policy, random.Random(seed))

    def score(w):
        return prefill_score(cached[w.worker_id], w.load, BLOCK_SIZE, policy)

    best = [w for w in workers if score(w) == max(map(score, workers))]
    assert chosen in best
    assert chosen.load.num_seqs == min(w.load.num_seqs for w in best)


@given(load=loads, runs=st.lists(st.integers(0, 64), min_size=2, max_size=8, unique=True), seed=st.integers())
def test_prefix_overlap_wins_when_loads_are_equal(load, runs, seed):
    workers = [WorkerInfo(f"p{i}", Role.PREFILL, "a:1", CONFIG, load) for i in range(len(runs))]
    cached = {w.worker_id: run for w, run in zip(workers, runs)}
    chosen = pick_prefill(workers, cached, BLOCK_SIZE, RoutingPolicy(), random.Random(seed))
    assert cached[chosen.worker_id] == max(runs)


@given(run=st.integers(1, 64), busy=st.integers(1, 64), idle=st.integers(0, 64), cost=st.integers(1, 2048),
       seed=st.integers())
def test_load_wins_when_overlap_is_small(run, busy, idle, cost, seed):
    assume(idle < busy and BLOCK_SIZE * run < cost * (busy - idle))
    cached_busy = WorkerInfo("busy", Role.PREFILL, "a:1", CONFIG, WorkerLoad(running=busy))
    empty_idle = WorkerInfo("idle", Role.PREFILL, "b:1", CONFIG, WorkerLoad(running=idle))
    chosen = pick_prefill([cached_busy, empty_idle], {"busy": run}, BLOCK_SIZE, RoutingPolicy(cost), random.Random(seed))
    assert chosen is empty_idle


def test_ties_spread_over_equal_workers():
    rng = random.Random(7)
    prefills = [WorkerInfo(f"p{i}", Role.PREFILL, "a:1", CONFIG, WorkerLoad(running=2)) for i in range(3)]
    decodes = [WorkerInfo(f"d{i}", Role.DECODE, "a:1", CONFIG, WorkerLoad(free_blocks=50)) for i in range(3)]
    picked_p = Counter(pick_prefill(prefills, {}, BLOCK_SIZE, RoutingPolicy(), rng).worker_id for _ in range(300))
    picked_d = Counter(pick_decode(decodes, 10, {}, BLOCK_SIZE, RoutingPolicy(), rng).worker_id for _ in range(300))
    assert min(picked_p.values()) > 60 and len(picked_p) == 3
    assert min(picked_d.values()) > 60 and len(picked_d) == 3


def test_load_only_mode_picks_least_loaded():
    prefills = [WorkerInfo("p0", Role.PREFILL, "a:1", CONFIG, WorkerLoad(running=3)),
                WorkerInfo("p1", Role.PREFILL, "a:1", CONFIG, WorkerLoad(waiting=1))]
    assert pick_prefill(prefills, {}, BLOCK_SIZE, RoutingPolicy(), random.Random(0)).worker_id == "p1"
    assert pick_prefill([], {}, BLOCK_SIZE, RoutingPolicy(), random.Random(0)) is None


def _ns(key_prefix: str, ttl_s: float = 3.0) -> ClusterNamespace:
    return ClusterNamespace(key_prefix, ttl_s=ttl_s)


async def _register(registry: WorkerRegistry, worker_id: str, role: Role, **load: int) -> None:
    await registry.heartbeat(WorkerInfo(worker_id, role, f"{worker_id}:5000", CONFIG, WorkerLoad(**load)))


async def _two_of_each(client, key_prefix: str, d1_free_blocks: int = 100) -> tuple[WorkerRegistry, PrefixIndex]:
    """The registry and prefix index of prefill workers p0, p1 and decode workers d0, d1 (100
    blocks each, all free but d1's ``100 - d1_free_blocks``)."""
    ns = _ns(key_prefix)
    registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
    for p in ("p0", "p1"):
        await _register(registry, p, Role.PREFILL, total_blocks=100, free_blocks=100)
    await _register(registry, "d0", Role.DECODE, total_blocks=100, free_blocks=100)
    await _register(registry, "d1", Role.DECODE, total_blocks=100, free_blocks=d1_free_blocks)
    return registry, index


def test_choose_prefers_cached_prefix_and_spreads_a_burst(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        registry, index = await _two_of_each(client, key_prefix)
        await index.publish("p1", stored=H[:4], removed=[])
        view = ClusterView(registry, index, CONFIG.model_id, RoutingPolicy(load_cost_tokens=64), random.Random(0),
                           outliers=outliers())
        await view.refresh()

        first = await view.choose(H, len(PROMPT))
        assert (first.prefill.worker_id, first.cached_blocks, first.prompt_blocks) == ("p1", 4, 7)
        # p1 now has one request in flight (cost 64 tokens > 16 saved): the next goes elsewhere.
        second = await view.choose(H, len(PROMPT))
        assert (second.prefill.worker_id, second.cached_blocks) == ("p0", 0)
        assert {first.decode.worker_id, second.decode.worker_id} == {"d0", "d1"}
        assert {w.worker_id: w.load.free_blocks for w in view.workers(Role.DECODE)} == {"d0": 93, "d1": 93}

        view.prefill_done(first)
        view.decode_done(first)
        third = await view.choose(H, len(PROMPT))
        assert third.prefill.worker_id == "p1" and third.decode.worker_id == first.decode.worker_id
        # A refresh that reads heartbeats from before these routes keeps counting them (second
        # and third are in flight); one that reads beats reporting them takes those as the
        # baseline, counted once.
        await view.refresh()
        in_flight = {"p0": 1, "p1": 1}
        assert {w.worker_id: w.load.num_seqs for w in view.workers(Role.PREFILL)} == in_flight
        await asyncio.sleep(0.2)  # the beats come well after the routes (a load's age has ms resolution)
        for p in ("p0", "p1"):
            await _register(registry, p, Role.PREFILL, running=1, total_blocks=100, free_blocks=100)
        await view.refresh()
        assert {w.worker_id: w.load.num_seqs for w in view.workers(Role.PREFILL)} == in_flight
        for route in (second, third):
            view.prefill_done(route)
        assert all(w.load.num_seqs == 0 for w in view.workers(Role.PREFILL))
        await client.aclose()

    asyncio.run(main())


def test_concurrent_requests_each_see_the_other_routed(key_prefix, redis_url):
    """Two requests routed at once (each awaiting its prefix lookup): the second is estimated
    with the first counted, so they go to different workers, not both to the best one."""
    async def main():
        client = redis_client(redis_url)
        registry, index = await _two_of_each(client, key_prefix, d1_free_blocks=99)
        await index.publish("p0", stored=H[:1], removed=[])  # p0 is the better prefill worker, d0 the roomier
        view = ClusterView(registry, index, CONFIG.model_id, rng=random.Random(0), outliers=outliers())
        await view.refresh()
        routes = await asyncio.gather(view.choose(H, len(PROMPT)), view.choose(H, len(PROMPT)))
        # whichever lookup came back first took the better pair
        assert sorted((r.prefill.worker_id, r.decode.worker_id) for r in routes) == [("p0", "d0"), ("p1", "d1")]
        await client.aclose()

    asyncio.run(main())


class _ReadHook(WorkerRegistry):
    """The real registry, with ``during_read`` run while the loads are on their way back."""

    during_read = staticmethod(lambda: None)

    async def live_workers(self, role):
        workers = await super().live_workers(role)
        self.during_read()
        return workers


def test_a_request_ending_while_loads_are_read_is_not_counted_twice(key_prefix, redis_url):
    """The worker reported the request running; it ends while that report is being read: the
    next estimate must not add the report's sequence to a count that no longer has it."""
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry, index = _ReadHook(client, ns), PrefixIndex(client, ns)
        await _register(registry, "p0", Role.PREFILL)
        await _register(registry, "d0", Role.DECODE, total_blocks=100, free_blocks=100)
        view = ClusterView(registry, index, CONFIG.model_id, outliers=outliers())
        await view.refresh()
        route = await view.choose(H, len(PROMPT))
        await asyncio.sleep(0.2)  # the beat comes well after the route (a load's age has ms resolution)
        await _register(registry, "p0", Role.PREFILL, running=1)  # its heartbeat mid-request
        registry.during_read = lambda: view.prefill_done(route)
        await view.refresh()
        assert [w.load.num_seqs for w in view.workers(Role.PREFILL)] == [0]
        await client.aclose()

    asyncio.run(main())


def test_choose_reports_missing_workers_and_capacity(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        view = ClusterView(registry, index, CONFIG.model_id, RoutingPolicy(decode_margin_blocks=1), outliers=outliers())
        await _register(registry, "p0", Role.PREFILL)
        await view.refresh()
        with pytest.raises(NoWorkerError, match="decode"):
            await view.choose(H, len(PROMPT))

        await _register(registry, "d0", Role.DECODE, free_blocks=7, total_blocks=8)  # needs 7 + 1
        await view.refresh()
        with pytest.raises(NoCapacityError, match="8 free blocks"):
            await view.choose(H, len(PROMPT))
        route = await view.choose(H[:5], len(PROMPT) - 4)  # 6 blocks + 1 fit
        assert route.decode.worker_id == "d0"

        with pytest.raises(ValueError, match="block hashes"):
            await view.choose(H[:2], len(PROMPT))
        await client.aclose()

    asyncio.run(main())


def test_registry_emptied_at_once_keeps_last_known_workers_for_one_ttl(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix, ttl_s=0.5)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        await _register(registry, "p0", Role.PREFILL)
        await _register(registry, "d0", Role.DECODE, free_blocks=100, total_blocks=100)
        view = ClusterView(registry, index, CONFIG.model_id, outliers=outliers())
        await view.refresh()
        # What a Redis restart looks like until the workers' next heartbeats.
        await client.delete(*[k async for k in client.scan_iter(match=f"tandem:{key_prefix}:*")])
        await view.refresh()
        assert (await view.choose(H, len(PROMPT))).prefill.worker_id == "p0"
        await asyncio.sleep(0.6)
        await view.refresh()
        with pytest.raises(NoWorkerError):
            await view.choose(H, len(PROMPT))
        await client.aclose()

    asyncio.run(main())


def test_last_known_loads_count_the_gateways_traffic_in_a_bounded_history(key_prefix, redis_url):
    """While loads stay last-known (Redis lost, no probe), every route and end since they were
    measured is counted, however long it lasts; what the count needs is kept, not every change."""
    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix, ttl_s=0.2)
        registry = WorkerRegistry(client, ns)
        await _register(registry, "d0", Role.DECODE, total_blocks=1000, free_blocks=1000)
        view = ClusterView(registry, PrefixIndex(client, ns), CONFIG.model_id, outliers=outliers())
        await view.refresh()
        await asyncio.sleep(0.05)
        held = []
        for i in range(120):  # six TTLs of traffic (280 changes) against one last-known load
            route = await view.choose(H, len(PROMPT))
            if i % 3:
                view.prefill_done(route)
                view.decode_done(route)
            else:
                held.append(route)
            await asyncio.sleep(0.01)
        [d0] = view.workers(Role.DECODE)
        assert (d0.load.num_seqs, d0.load.free_blocks) == (len(held), 1000 - 7 * len(held))
        # A TTL holds at most 20 routes (47 changes); older ones were merged.
        assert len(view._in_flight._history["d0"]) < 100, "changes older than a load can be were kept"
        await client.aclose()

    asyncio.run(main())


def test_redis_outage_degrades_to_last_known_state_and_recovers(private_redis):
    async def main():
        ns = ClusterNamespace("test-outage", ttl_s=1.0)
        worker_client, gateway_client = redis_client(private_redis.url, 0.2), redis_client(private_redis.url, 0.2)
        pool = BlockPool(8)
        for block, h in zip(pool.allocate(3), H):
            pool.cache(block, h)
        worker_registry = WorkerRegistry(worker_client, ns)
        prefill = Heartbeat(worker_registry, WorkerInfo("p0", Role.PREFILL, "p0:5000", CONFIG),
                            lambda: WorkerLoad(running=1, free_blocks=5, total_blocks=8),
                            index=PrefixIndex(worker_client, ns), blocks=pool, interval_s=0.1)
        decode = Heartbeat(worker_registry, WorkerInfo("d0", Role.DECODE, "d0:5000", CONFIG),
                           lambda: WorkerLoad(free_blocks=64, total_blocks=64), interval_s=0.1)
        prefill.start()
        decode.start()
        view = ClusterView(WorkerRegistry(gateway_client, ns), PrefixIndex(gateway_client, ns), CONFIG.model_id,
                           outliers=outliers())
        await asyncio.sleep(0.3)
        await view.refresh()
        route = await view.choose(H, len(PROMPT))
        assert (route.prefill.worker_id, route.decode.worker_id, route.cached_blocks) == ("p0", "d0", 3)

        private_redis.kill()
        await asyncio.sleep(0.3)  # heartbeats fail meanwhile (and must not die)
        await view.refresh()
        assert view.degraded
        route = await view.choose(H, len(PROMPT))
        assert (route.prefill.worker_id, route.decode.worker_id, route.cached_blocks) == ("p0", "d0", 0)

        private_redis.start()  # same port, empty: the heartbeats re-register and resync
        await asyncio.sleep(0.5)
        await view.refresh()
        assert not view.degraded
        route = await view.choose(H, len(PROMPT))
        assert (route.prefill.worker_id, route.decode.worker_id, route.cached_blocks) == ("p0", "d0", 3)

        await prefill.stop()
        await decode.stop()
        assert await view.registry.live_workers(Role.PREFILL) == []
        await worker_client.aclose()
        await gateway_client.aclose()

    asyncio.run(main())


def test_during_an_outage_loads_are_read_from_the_workers_themselves(private_redis):
    """A pool published full just before Redis went away (a burst's last heartbeat) is routable
    again once the workers say they have room: the view reads their loads with its probe; a worker
    that does not answer keeps its last-known load."""
    async def main():
        ns = ClusterNamespace("test-outage-probe", ttl_s=1.0)
        worker_client, gateway_client = redis_client(private_redis.url, 0.2), redis_client(private_redis.url, 0.2)
        registry = WorkerRegistry(worker_client, ns)
        decode = WorkerInfo("d0", Role.DECODE, "d0:5000", CONFIG, WorkerLoad(free_blocks=0, total_blocks=64))
        await registry.heartbeat(decode)
        answers = {"d0": WorkerLoad(free_blocks=64, total_blocks=64)}

        async def probe(worker: WorkerInfo) -> WorkerLoad | None:
            return answers.get(worker.worker_id)

        view = ClusterView(WorkerRegistry(gateway_client, ns), PrefixIndex(gateway_client, ns), CONFIG.model_id,
                           load_probe=probe, outliers=outliers())
        await view.refresh()
        with pytest.raises(NoCapacityError):
            await view.choose(H, len(PROMPT))
        private_redis.kill()
        answers.clear()  # d0 does not answer: its last-known load holds
        await view.refresh()
        assert view.degraded
        with pytest.raises(NoCapacityError):
            await view.choose(H, len(PROMPT))
        answers["d0"] = WorkerLoad(free_blocks=64, total_blocks=64)
        await view.refresh()
        route = await view.choose(H, len(PROMPT))
        assert route.decode.worker_id == "d0" and route.decode.load.free_blocks == 64  # as the worker said
        private_redis.start()
        await worker_client.aclose()
        await gateway_client.aclose()

    asyncio.run(main())


def test_in_process_index_learns_from_routing_when_there_is_no_redis(key_prefix, redis_url):
    """The no-Redis fallback: ``RoutedPrefixIndex`` remembers what the view routed where."""
    from gateway.static_cluster import RoutedPrefixIndex

    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        for p in ("p0", "p1"):
            await _register(registry, p, Role.PREFILL, total_blocks=100, free_blocks=100)
        await _register(registry, "d0", Role.DECODE, total_blocks=100, free_blocks=100)
        index = RoutedPrefixIndex(capacity_blocks=6)
        view = ClusterView(registry, index, CONFIG.model_id, RoutingPolicy(load_cost_tokens=8), random.Random(0),
                           outliers=outliers())
        await view.refresh()
        first = await view.choose(H, len(PROMPT))
        assert first.cached_blocks == 0
        view.prefill_done(first)
        view.decode_done(first)
        again = await view.choose(H, len(PROMPT))
        assert (again.prefill.worker_id, again.cached_blocks) == (first.prefill.worker_id, 6)
        other = "p1" if first.prefill.worker_id == "p0" else "p0"
        assert (await index.cached_runs([other], H)) == {other: 0}
        # LRU bound: three newer hashes push out the oldest three, so the leading run is gone.
        index.note_routed(first.prefill.worker_id, [bytes([i]) * 16 for i in range(3)])
        assert (await index.cached_runs([first.prefill.worker_id], H)) == {first.prefill.worker_id: 0}
        await client.aclose()

    asyncio.run(main())


def test_choose_avoids_excluded_workers_while_others_exist(key_prefix, redis_url):
    """A retry goes to a different worker whenever one exists, and books its counts once."""
    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        for name, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
            await _register(registry, name, role, total_blocks=100, free_blocks=100)
        view = ClusterView(registry, PrefixIndex(client, _ns(key_prefix)), CONFIG.model_id, rng=random.Random(0),
                           outliers=outliers())
        await view.refresh()
        first = await view.choose(H, len(PROMPT))
        view.prefill_done(first)
        view.decode_done(first)
        retry = await view.choose(H, len(PROMPT), exclude=frozenset({first.prefill.worker_id, first.decode.worker_id}))
        assert retry.prefill.worker_id != first.prefill.worker_id and retry.decode.worker_id != first.decode.worker_id
        view.prefill_done(retry)
        view.decode_done(retry)
        assert all(w.load.num_seqs == 0 for role in Role for w in view.workers(role))
        assert {w.load.free_blocks for w in view.workers(Role.DECODE)} == {100}
        alone = await view.choose(H, len(PROMPT), exclude=frozenset({"d0", "d1"}))  # no other decode worker: allowed
        assert alone.decode.worker_id in ("d0", "d1")
        view.prefill_done(alone)
        view.decode_done(alone)
        local = await view.choose(H, len(PROMPT), exclude=frozenset({"p0", "p1"}))  # the decode worker prefills
        assert local.prefill is None
        await client.aclose()

    asyncio.run(main())


def test_workers_that_disagree_with_the_pool_are_refused(key_prefix, redis_url, caplog):
    """Workers publish their cache settings; one of another model, block size, weights or KV
    cache dtype never joins the pool (a clear log line and the refused-workers gauge say so)."""
    import dataclasses

    from gateway import metrics

    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        await _register(registry, "p0", Role.PREFILL)
        await _register(registry, "d0", Role.DECODE, free_blocks=100, total_blocks=100)
        odd = dataclasses.replace(CONFIG, block_size=32)
        await registry.heartbeat(WorkerInfo("d1", Role.DECODE, "d1:5000", odd, WorkerLoad(free_blocks=100)))
        shorter = dataclasses.replace(CONFIG, max_model_len=512)  # less KV memory: joins, and lowers the limit
        await registry.heartbeat(WorkerInfo("d2", Role.DECODE, "d2:5000", shorter, WorkerLoad(free_blocks=100)))
        other_model = dataclasses.replace(CONFIG, model_id="another/model")
        await registry.heartbeat(WorkerInfo("p1", Role.PREFILL, "p1:5000", other_model))
        quantized = dataclasses.replace(CONFIG, quantization="gguf")  # the same model, other weights: other KV
        await registry.heartbeat(WorkerInfo("d3", Role.DECODE, "d3:5000", quantized, WorkerLoad(free_blocks=100)))
        fp8 = dataclasses.replace(CONFIG, kv_cache_dtype="fp8_e4m3")  # same hash seed even: its KV bytes differ
        await registry.heartbeat(WorkerInfo("p2", Role.PREFILL, "p2:5000", fp8))
        view = ClusterView(registry, PrefixIndex(client, _ns(key_prefix)), CONFIG.model_id, outliers=outliers())
        await view.refresh()
        assert view.pool == dataclasses.replace(CONFIG, max_model_len=512) and view.routable
        assert [w.worker_id for role in Role for w in view.workers(role)] == ["p0", "d0", "d2"]
        assert metrics.REFUSED_WORKERS._value.get() == 4
        text = caplog.text
        assert "refusing decode worker d1" in text and "block_size (32 vs 4)" in text
        assert "refusing prefill worker p1" in text and "another/model" in text
        assert "refusing decode worker d3" in text and "quantization" in text
        assert "refusing prefill worker p2" in text and "kv_cache_dtype" in text and "fp8_e4m3" in text
        await client.aclose()

    asyncio.run(main())


def test_workers_of_any_tp_sizes_share_a_pool_but_a_pair_without_a_common_transport_is_never_routed(
        key_prefix, redis_url, caplog):
    """Tensor-parallel sizes and transports are each worker's own: every worker joins the pool;
    the prefill worker that cannot send KV to the chosen decode worker (NIXL only, against a
    decode worker taking gRPC only) is left out, and the log says why, once."""
    nixl_tp2 = dataclasses.replace(CONFIG, tensor_parallel_size=2, kv_transports=("nixl",))
    grpc_tp1 = dataclasses.replace(CONFIG, tensor_parallel_size=1, kv_transports=("grpc",))
    both_tp4 = dataclasses.replace(CONFIG, tensor_parallel_size=4, kv_transports=("nixl", "grpc"))

    async def main():
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, _ns(key_prefix))
        await registry.heartbeat(WorkerInfo("p-nixl", Role.PREFILL, "p0:1", nixl_tp2))
        await registry.heartbeat(WorkerInfo("p-both", Role.PREFILL, "p1:1", both_tp4, WorkerLoad(running=3)))
        await registry.heartbeat(WorkerInfo("d-grpc", Role.DECODE, "d0:1", grpc_tp1, WorkerLoad(free_blocks=50, total_blocks=50)))
        view = ClusterView(registry, PrefixIndex(client, _ns(key_prefix)), CONFIG.model_id, rng=random.Random(0),
                           outliers=outliers())
        await view.refresh()
        assert {w.worker_id for w in view.workers(Role.PREFILL)} == {"p-nixl", "p-both"}  # no refusal
        for _ in range(3):  # p-nixl is idle, p-both busy: only the transport keeps p-nixl out
            route = await view.choose(H, len(PROMPT))
            assert (route.prefill.worker_id, route.decode.worker_id) == ("p-both", "d-grpc")
        await client.aclose()

    with caplog.at_level(logging.WARNING, logger="gateway.router"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if "not pairing" in r.getMessage()]
    assert len(lines) == 1 and "p-nixl" in lines[0] and "no KV transport in common" in lines[0], lines


def test_a_prefill_worker_on_the_decode_workers_gpu_is_picked_only_when_no_other_can_take_it(key_prefix, redis_url):
    """``p-shared`` runs on the decode worker's GPU and caches the whole prompt, ``p-apart`` on
    another GPU caches nothing and is busier: routing still picks ``p-apart`` (two processes
    time-slice a GPU), and ``p-shared`` only once ``p-apart`` is excluded."""
    def on(*gpus: str):
        return dataclasses.replace(CONFIG, device_ids=gpus)

    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        await registry.heartbeat(WorkerInfo("p-shared", Role.PREFILL, "p0:1", on("GPU-a")))
        await registry.heartbeat(WorkerInfo("p-apart", Role.PREFILL, "p1:1", on("GPU-b"), WorkerLoad(running=6)))
        await registry.heartbeat(WorkerInfo("d", Role.DECODE, "d0:1", on("GPU-a"), WorkerLoad(free_blocks=50, total_blocks=50)))
        await index.publish("p-shared", stored=H, removed=[])
        view = ClusterView(registry, index, CONFIG.model_id, rng=random.Random(0), outliers=outliers())
        await view.refresh()
        for exclude, expected in ((frozenset(), "p-apart"), (frozenset({"p-apart"}), "p-shared")):
            route = await view.choose(H, len(PROMPT), exclude=exclude)
            assert route.prefill.worker_id == expected
            view.prefill_done(route)
            view.decode_done(route)
        await client.aclose()

    asyncio.run(main())


def test_a_route_offers_the_least_loaded_decode_worker_that_can_prefill_for_it_and_counts_it_once_lent(
        key_prefix, redis_url):
    """Lenders: decode workers that serve prefill. Of them routing offers the one with the best
    prefill score that is not the request's decode worker, has room for the prompt, runs on none
    of its GPUs, can send it KV and is not avoided; the request is counted on it only once
    placement lends it the prefill, and no longer on the prefill worker."""
    def config(gpu: str, *, lends: bool = True, transports: tuple[str, ...] = ("grpc",)):
        return dataclasses.replace(CONFIG, device_ids=(gpu,), serves_prefill=lends, kv_transports=transports)

    async def main():
        client = redis_client(redis_url)
        ns = _ns(key_prefix)
        registry, index = WorkerRegistry(client, ns), PrefixIndex(client, ns)
        room, busy = WorkerLoad(free_blocks=50, total_blocks=50), WorkerLoad(running=8, free_blocks=50, total_blocks=50)
        for worker_id, cfg, load in (
                ("d-own", config("GPU-a", lends=False), room),  # holds the prompt: the request's decode worker
                ("l-idle", config("GPU-b"), room), ("l-busy", config("GPU-c"), busy),
                ("l-full", config("GPU-d"), WorkerLoad(free_blocks=3, total_blocks=50)),
                ("l-same-gpu", config("GPU-a"), room), ("l-nixl", config("GPU-e", transports=("nixl",)), room),
                ("d-plain", config("GPU-f", lends=False), room)):
            await registry.heartbeat(WorkerInfo(worker_id, Role.DECODE, f"{worker_id}:1", cfg, load))
        await registry.heartbeat(WorkerInfo("p0", Role.PREFILL, "p0:1", config("GPU-g", lends=False)))
        await index.publish("d-own", stored=H, removed=[])
        view = ClusterView(registry, index, CONFIG.model_id, rng=random.Random(0), outliers=outliers())
        await view.refresh()
        route = await view.choose(H, len(PROMPT))
        assert (route.prefill.worker_id, route.decode.worker_id, route.lender.worker_id) == ("p0", "d-own", "l-idle")
        assert route.lender_cached_blocks == 0
        assert {w.worker_id: w.load.num_seqs for w in view.workers(Role.DECODE)}["l-idle"] == 0  # offered, not counted
        lent = view.lend(route, H)
        assert (lent.prefill.worker_id, lent.decode, lent.lender) == ("l-idle", route.decode, None)
        seqs = {w.worker_id: w.load.num_seqs for role in Role for w in view.workers(role)}
        assert (seqs["p0"], seqs["l-idle"], seqs["d-own"]) == (0, 1, 1)
        view.prefill_done(lent)
        view.decode_done(lent)
        assert all(w.load.num_seqs == 0 for w in view.workers(Role.PREFILL)) and \
            {w.worker_id: w.load.num_seqs for w in view.workers(Role.DECODE)}["l-idle"] == 0
        retry = await view.choose(H, len(PROMPT), exclude=frozenset({"l-idle"}))
        assert retry.lender.worker_id == "l-busy"  # the next best; never an excluded one
        view.prefill_done(retry)
        view.decode_done(retry)
        none_left = await view.choose(H, len(PROMPT), exclude=frozenset({"l-idle", "l-busy"}))
        assert none_left.lender is None
        with pytest.raises(ValueError, match="no lender"):
            view.lend(none_left, H)
        await client.aclose()

    asyncio.run(main())
