"""A decode stream that stops producing tokens while its connection stays up (keepalive set
far longer than the stall timeout, so only ``decode_stall_timeout_s`` can notice): real
processes, two decode workers that prefill locally, a gateway.

Before the first token a stalled stream is retried on the other worker (the client sees
nothing); after it a stream that cannot be resumed elsewhere (unseeded sampling, as here; greedy
and seeded ones are resumed, ``test_fault_matrix.py``) ends with UNAVAILABLE; no request waits on the frozen worker past the
stall timeout (a Decode stream) or the per-hop timeout (an Admit)."""

from __future__ import annotations

import signal
import time

import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, ClosedLoop, shared_redis_cluster, stats

pytestmark = pytest.mark.slow
STALL_S = 2.0
FREEZE_S = 8.0
HOP_S = 2.0
SETTINGS = {"TANDEM_KEEPALIVE_TIME_S": "30", "TANDEM_KEEPALIVE_TIMEOUT_S": "30",
            "TANDEM_DECODE_STALL_TIMEOUT_S": str(STALL_S), "TANDEM_HOP_TIMEOUT_S": str(HOP_S),
            "TANDEM_LOCAL_PREFILL_MAX_TOKENS": "256"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    with shared_redis_cluster(tmp_path_factory.mktemp("stall"), "stall", redis_url, num_prefill=0, num_decode=2,
                              kv_transport="grpc", env=SETTINGS) as cluster:
        yield cluster


def test_a_stalled_decode_stream_fails_over_before_its_first_token_and_is_unavailable_after(cluster):
    victim = cluster.workers["decode-0"]

    def request(i: int) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(prompt=f"Tell me a story, number {i}.",
                                           sampling=SP(max_tokens=24, temperature=0.8, ignore_eos=True))

    load = ClosedLoop(cluster.stub, request, streams=8).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = stats(cluster, victim.address, "decode")
        if s.num_running >= 2:
            break
        time.sleep(0.01)
    victim.proc.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        time.sleep(FREEZE_S)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    outcomes = load.stop()
    during = [o for o in outcomes if o.started < frozen_at + FREEZE_S and o.ended > frozen_at]
    assert max(o.longest_silence_s for o in during) < max(STALL_S, HOP_S) + 2.5, \
        sorted(round(o.longest_silence_s, 2) for o in during)
    failed = [o for o in outcomes if o.code != "OK"]
    assert failed, "no stream was decoding on the frozen worker"
    assert all(o.code == "UNAVAILABLE" and o.tokens >= 1 for o in failed), [(o.code, o.tokens) for o in failed]
    assert all(o.tokens == 24 for o in outcomes if o.code == "OK")
