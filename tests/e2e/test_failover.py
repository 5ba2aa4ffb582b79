"""Failover under load, real processes: 2 prefill + 2 decode workers and a gateway on loopback,
32 (or 8) closed-loop streams, one worker killed (SIGKILL) or frozen (SIGSTOP) mid-run.

What must hold: a dead prefill worker costs (almost) no request (retried elsewhere before the
first token, the dead worker ejected and probed down); a dead decode worker costs no greedy or
seeded request (those not yet streaming are retried, those streaming are resumed on the other
decode worker, unchanged), and an unseeded sampled stream it was decoding ends UNAVAILABLE; a frozen decode worker stops
getting new requests within 5 s, no request waits past the per-hop timeout, and it is routed to
again once it thaws; every surviving worker's free blocks return to where they started. A
rolling SIGTERM of every worker in turn (each drains: NOT_SERVING, finishes what it holds,
leaves the registry, exits 0, and is started again) drops no request at all, prefill-1 included,
which has no drain time: its server stops with calls in it (as a drain that runs out of time
does), and the gateway retries them elsewhere.
"""

from __future__ import annotations

import signal
import time

import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import (
    EXACT_RESUME, SP, ClosedLoop, collect, free_blocks, shared_redis_cluster, stats, stream_killing_its_decode_worker,
    wait_free_blocks,
)

pytestmark = pytest.mark.slow
HOP_TIMEOUT_S = 8.0
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "def fibonacci(n):", "Once upon a time, in a small village,", "The quick brown fox"]
LIVENESS = {"TANDEM_KEEPALIVE_TIME_S": "1", "TANDEM_KEEPALIVE_TIMEOUT_S": "1",
            "TANDEM_HEALTH_PROBE_INTERVAL_S": "0.5", "TANDEM_HEALTH_PROBE_TIMEOUT_S": "1",
            "TANDEM_HOP_TIMEOUT_S": str(HOP_TIMEOUT_S), "TANDEM_DECODE_STALL_TIMEOUT_S": "5",
            "TANDEM_OUTLIER_BASE_EJECTION_S": "2"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    with shared_redis_cluster(tmp_path_factory.mktemp("failover"), "failover", redis_url, num_prefill=2, num_decode=2,
                              kv_transport="grpc", env={**LIVENESS, **EXACT_RESUME},
                              worker_env={"prefill-1": {"TANDEM_DRAIN_TIMEOUT_S": "0"}}) as cluster:
        yield cluster


@pytest.fixture
def healed(cluster):
    """Every worker running (one killed by an earlier test is restarted) and idle."""
    for name, worker in cluster.workers.items():
        if not worker.alive:
            cluster.restart(name)
    time.sleep(1.5)  # the gateway's probe and refresh see the restarted worker
    return cluster


def _request(i: int, max_tokens: int = 8) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=f"{PROMPTS[i % len(PROMPTS)]} (request {i})",
                                       sampling=SP(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _wait_completed(load: ClosedLoop, count: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while load.completed() < count and time.monotonic() < deadline:
        time.sleep(0.1)


def test_sigkill_of_a_prefill_worker_under_load_fails_almost_no_request(healed):
    cluster = healed
    before = free_blocks(cluster)
    load = ClosedLoop(cluster.stub, _request, streams=32).start()
    _wait_completed(load, 32, within_s=120)
    cluster.workers["prefill-0"].proc.send_signal(signal.SIGKILL)
    killed_at_completed = load.completed()
    _wait_completed(load, killed_at_completed + 96, within_s=120)
    outcomes = load.stop()
    failed = [o for o in outcomes if o.code != "OK"]
    assert len(outcomes) >= 128 and len(failed) <= len(outcomes) // 100, [(o.code, o.tokens) for o in failed]
    survivors = {k: v for k, v in before.items() if k != "prefill-0"}
    assert wait_free_blocks(cluster, survivors, within_s=5) == survivors


def test_sigstop_of_a_decode_worker_routes_around_it_within_5_s_and_back_after(healed):
    cluster = healed
    before = free_blocks(cluster)
    victim = cluster.workers["decode-0"]
    load = ClosedLoop(cluster.stub, lambda i: _request(i, 16), streams=8).start()
    _wait_completed(load, 16, within_s=120)
    victim.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Frozen long enough that, 5 s in, requests of several seconds each (2 busy cores) still
        # start and end around it, 8 of them at least.
        time.sleep(20)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    thawed_at = time.monotonic()
    back = False
    while not back and time.monotonic() < thawed_at + 10:  # routed to again once it answers its probe
        s = stats(cluster, victim.address, "decode")
        back = s.num_running + s.num_waiting > 0
        time.sleep(0.05)
    outcomes = load.stop()
    late = [o for o in outcomes if stopped_at + 5 <= o.started and o.ended <= thawed_at]
    assert len(late) >= 8 and all(o.code == "OK" for o in late), [(o.code, o.ended - o.started) for o in late]
    assert max(o.longest_silence_s for o in outcomes) < HOP_TIMEOUT_S + 2, \
        sorted(round(o.longest_silence_s, 2) for o in outcomes)[-8:]
    failed = [o for o in outcomes if o.code != "OK"]
    assert all(o.code == "UNAVAILABLE" and o.tokens >= 1 for o in failed), [(o.code, o.tokens) for o in failed]
    assert back, "the thawed decode worker got no new request within 10 s"
    # Within one lease (TANDEM_LEASE_S, 30 s): a reservation whose Abort expired while its worker
    # was frozen is freed by its lease.
    assert wait_free_blocks(cluster, before, within_s=35) == before


def test_sigkill_of_a_decode_worker_under_load_fails_no_greedy_request(healed):
    """Requests not yet streaming are retried elsewhere; the greedy streams the dead worker was
    decoding are resumed on the other one (the stream test below checks they are unchanged)."""
    cluster = healed
    before = free_blocks(cluster)
    victim = cluster.workers["decode-1"]
    load = ClosedLoop(cluster.stub, lambda i: _request(i, 24), streams=32).start()
    _wait_completed(load, 32, within_s=120)
    s = stats(cluster, victim.address, "decode")
    assert s.num_running + s.num_waiting > 0  # the kill hits streams in flight
    victim.proc.send_signal(signal.SIGKILL)
    killed_at_completed = load.completed()
    _wait_completed(load, killed_at_completed + 64, within_s=120)
    outcomes = load.stop()
    failed = [(o.code, o.tokens) for o in outcomes if o.code != "OK"]
    assert not failed, failed
    survivors = {k: v for k, v in before.items() if k != "decode-1"}
    assert wait_free_blocks(cluster, survivors, within_s=5) == survivors


STORY = '{"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}'
RESUME_SAMPLING = {"greedy": SP(max_tokens=64, temperature=0, ignore_eos=True),
                   "seeded": SP(max_tokens=64, temperature=0.8, seed=7, ignore_eos=True),
                   "unseeded": SP(max_tokens=64, temperature=0.8, ignore_eos=True),
                   # the new decode worker replays the tokens sent into its grammar and its counts
                   "structured": SP(max_tokens=64, temperature=0.8, seed=7, json_schema=STORY, frequency_penalty=0.5,
                                    min_tokens=40)}


@pytest.mark.parametrize("kind", list(RESUME_SAMPLING))
def test_a_stream_whose_decode_worker_dies_is_resumed_elsewhere_when_reproducible(healed, kind):
    """SIGKILL of the decode worker of a stream the client has 8 tokens of: a greedy or seeded
    stream goes on on the other decode worker, identical to a fault-free run (tokens, text,
    usage; a structured output with penalties too); an unseeded sampled one cannot be
    reproduced and ends with UNAVAILABLE."""
    cluster = healed
    request = gateway_pb2.GenerateRequest(prompt="Tell a long story about a lighthouse keeper.",
                                          sampling=RESUME_SAMPLING[kind])
    reference = collect(cluster.stub, request)["samples"][0] if kind != "unseeded" else None
    before = free_blocks(cluster)
    seen = stream_killing_its_decode_worker(cluster, request, after_tokens=8)
    token_ids, text, finish, usage, code, victim = (seen.token_ids, seen.text, seen.finish, seen.usage, seen.code,
                                                    seen.victim)
    assert victim is not None
    if kind == "unseeded":
        assert code == "UNAVAILABLE" and len(token_ids) >= 8, (code, len(token_ids))
    else:
        assert code == "OK"
        assert (token_ids, text, finish) == (reference["token_ids"], reference["text"], reference["finish"])
        assert usage.completion_tokens == len(token_ids) == 64 and usage.prompt_tokens > 0
    survivors = {k: v for k, v in before.items() if k != victim}
    assert wait_free_blocks(cluster, survivors, within_s=5) == survivors


def test_rolling_sigterm_of_every_worker_under_load_drops_no_request(healed):
    cluster = healed
    load = ClosedLoop(cluster.stub, lambda i: _request(i, 16), streams=16).start()
    _wait_completed(load, 16, within_s=120)
    for name in ("prefill-0", "decode-0", "prefill-1", "decode-1"):
        worker = cluster.workers[name]
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(30) == 0, name
        cluster.restart(name)
        completed = load.completed()
        _wait_completed(load, completed + 16, within_s=60)  # the pool serves on before the next one goes
    outcomes = load.stop()
    assert len(outcomes) >= 80
    assert all(o.code == "OK" and o.tokens == 16 for o in outcomes), \
        [(o.code, o.tokens) for o in outcomes if o.code != "OK" or o.tokens != 16]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        totals = {name: stats(cluster, w.address, name.split("-")[0]) for name, w in cluster.workers.items()}
        if all(s.num_free_blocks == s.num_total_blocks for s in totals.values()):
            break
        time.sleep(0.1)
    assert {n: (s.num_free_blocks, s.num_total_blocks) for n, s in totals.items()
            if s.num_free_blocks != s.num_total_blocks} == {}
