"""Outlier detection (consecutive failures eject for a growing time, the probe's verdict) and
how routing uses it: avoided workers are skipped while others exist, never when none does."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import REGISTRY

from cluster.prefix_index import PrefixIndex
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from engine.block_hash import hash_blocks
from gateway.outlier import OutlierDetector
from gateway.router import ClusterView
from tests.helpers.gateway import Clock
from tests.helpers.worker_config import BLOCK_SIZE, CONFIG

PROMPT = list(range(3 * BLOCK_SIZE))
H = hash_blocks(PROMPT, BLOCK_SIZE, CONFIG.hash_seed)


def ejected(detector: OutlierDetector, worker_id: str) -> bool:
    return worker_id in detector.avoided()[1]


def test_consecutive_failures_eject_for_a_doubling_time_capped_and_forgotten():
    clock = Clock()
    detector = OutlierDetector(consecutive_failures=2, base_ejection_s=5, max_ejection_s=12, clock=clock)
    assert not detector.failure("w")
    detector.success("w")  # a success breaks the run
    assert not detector.failure("w") and not ejected(detector, "w")
    assert detector.failure("w") and ejected(detector, "w")
    assert not detector.failure("w")  # calls already sent fail too: the ejection stands as it is
    clock.now += 4.9
    assert ejected(detector, "w")
    clock.now += 0.2
    assert not ejected(detector, "w")
    detector.failure("w")
    assert detector.failure("w")  # second ejection: 10 s
    clock.now += 9.9
    assert ejected(detector, "w")
    clock.now += 0.2
    detector.failure("w")
    detector.failure("w")  # third: 20 s, capped at 12
    clock.now += 11.9
    assert ejected(detector, "w")
    clock.now += 0.2
    assert not ejected(detector, "w")
    clock.now += 12  # max_ejection_s without an ejection: back to the base time
    detector.failure("w")
    detector.failure("w")
    clock.now += 5.1
    assert not ejected(detector, "w")


def test_probe_failure_marks_down_and_a_serving_answer_ends_down_and_ejection():
    clock = Clock()
    detector = OutlierDetector(consecutive_failures=1, base_ejection_s=30, max_ejection_s=30, clock=clock)
    detector.failure("w")
    assert detector.probe_failed("w") and not detector.probe_failed("w")  # True only when it changes
    assert detector.avoided() == (frozenset({"w"}), frozenset({"w"}))
    assert detector.probe_ok("w") and not detector.probe_ok("w")
    assert detector.avoided() == (frozenset(), frozenset())
    detector.probe_failed("x")
    detector.retain(["w"])  # x left the registry
    assert detector.avoided()[0] == frozenset()


def avoided_gauge(reason: str) -> float:
    return REGISTRY.get_sample_value("tandem_gateway_avoided_workers", {"reason": reason})


def test_the_avoided_workers_gauge_reads_the_detector_when_scraped_so_a_lapsed_ejection_is_not_reported():
    clock = Clock()
    detector = OutlierDetector(consecutive_failures=1, base_ejection_s=5, max_ejection_s=5, clock=clock)
    detector.failure("w")
    detector.probe_failed("x")
    assert (avoided_gauge("ejected"), avoided_gauge("down")) == (1, 1)
    detector.probe_ok("x")
    assert (avoided_gauge("ejected"), avoided_gauge("down")) == (1, 0)
    clock.now += 5.1  # nothing happens at the ejection's end, yet the gauge must read 0
    assert avoided_gauge("ejected") == 0


def test_settings_out_of_range_are_refused_by_name():
    with pytest.raises(ValueError, match="consecutive_failures"):
        OutlierDetector(consecutive_failures=0, base_ejection_s=5, max_ejection_s=60)
    with pytest.raises(ValueError, match="max_ejection_s"):
        OutlierDetector(consecutive_failures=2, base_ejection_s=10, max_ejection_s=5)


def test_routing_skips_down_and_ejected_workers_while_others_exist(key_prefix, redis_url):
    async def main():
        client = redis_client(redis_url)
        ns = ClusterNamespace(key_prefix, 3.0)
        registry = WorkerRegistry(client, ns)
        for name, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
            await registry.heartbeat(WorkerInfo(name, role, f"{name}:5000", CONFIG,
                                                WorkerLoad(free_blocks=100, total_blocks=100)))
        detector = OutlierDetector(consecutive_failures=1, base_ejection_s=60, max_ejection_s=60)
        view = ClusterView(registry, PrefixIndex(client, ns), CONFIG.model_id, rng=random.Random(0),
                           outliers=detector)
        await view.refresh()

        async def picks(exclude=frozenset()) -> set[tuple]:
            seen = set()
            for _ in range(20):
                route = await view.choose(H, len(PROMPT), exclude=exclude)
                view.prefill_done(route)
                view.decode_done(route)
                seen.add((route.prefill.worker_id if route.prefill else None, route.decode.worker_id))
            return seen

        assert {p for p, _ in await picks()} == {"p0", "p1"}
        detector.failure("p0")  # ejected
        detector.probe_failed("d1")  # down
        assert await picks() == {("p1", "d0")}
        detector.probe_failed("p1")
        assert await picks() == {("p0", "d0")}  # an ejected prefill worker beats none while it is not down
        assert await picks(frozenset({"p0"})) == {(None, "d0")}  # excluded and down: the decode worker prefills
        assert await picks(frozenset({"d0"})) == {("p0", "d0")}  # no other decode worker is up: d0 again
        detector.probe_failed("d0")
        assert {d for _, d in await picks()} == {"d0", "d1"}  # all down: any (the call decides)
        await client.aclose()

    asyncio.run(main())
