"""End to end under failure: overload, Redis going away and coming back, a decode worker killed
mid-request. One prefill + two decode workers with small KV pools and a
private redis-server (this module kills it), all real processes on loopback."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from protos.tandem.v1 import gateway_pb2
from cli.redis_server import RedisServer

from tests.helpers.cluster import SP, collect, free_blocks, gateway_stub, log_text, start_cluster, stats, \
    wait_free_blocks

pytestmark = pytest.mark.slow
DECODE_BLOCKS = 40


@pytest.fixture(scope="module")
def env(tmp_path_factory, kv_transport):
    tmp = tmp_path_factory.mktemp("failures")
    private = RedisServer(tmp)
    private.start()
    decode_env = {"TANDEM_NUM_BLOCKS": str(DECODE_BLOCKS)}
    try:
        cluster = start_cluster(
            tmp, f"test-fail-{uuid.uuid4().hex[:8]}", private.url, num_prefill=1, num_decode=2,
            kv_transport=kv_transport, env={"TANDEM_ADMIT_WAIT_S": "3"},
            worker_env={"decode-0": decode_env, "decode-1": decode_env})
        cluster.tmp, cluster.private_redis = tmp, private
        channel, stub = gateway_stub(cluster)
        yield cluster, stub
        channel.close()
        cluster.stop()
    finally:
        private.stop()


def _req(prompt: str, max_tokens: int, request_id: str = "", **kw) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt,
                                       sampling=SP(max_tokens=max_tokens, temperature=0, **kw))


def test_overload_queues_or_refuses_never_crashes_or_leaks(env):
    cluster, stub = env
    before = free_blocks(cluster)
    prompt = "Summarize the history of the Roman Empire in detail. " * 8  # about 90 tokens: 6 blocks

    def one(i: int):
        try:
            out = collect(stub, _req(prompt + str(i), 48, ignore_eos=True), timeout_s=120)
            return "OK", len(out["samples"][0]["token_ids"])
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()

    with ThreadPoolExecutor(24) as pool:  # ~24 x 9 blocks wanted, 2 x 40 in the decode pool
        results = list(pool.map(one, range(24)))
    codes = {code for code, _ in results}
    assert codes <= {"OK", "RESOURCE_EXHAUSTED"}, results
    assert all(n == 48 for code, n in results if code == "OK"), results
    assert "OK" in codes
    # every block comes back: the last Aborts of 24 concurrent streams may take seconds on busy cores
    assert wait_free_blocks(cluster, before, within_s=15) == before
    assert not cluster.dead()


def test_redis_outage_keeps_serving_and_recovers(env):
    cluster, stub = env
    private = cluster.private_redis
    # Routing keeps the last loads published before the outage: wait until the decode workers
    # have published their room again after the previous test's burst, and the gateway has read it.
    client = redis.Redis.from_url(private.url)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(
            int(client.hget(key, "free_blocks") or 0) < DECODE_BLOCKS // 2
            for key in client.scan_iter(match="tandem:*:worker:decode-*") if not key.endswith(b":blocks")):
        time.sleep(0.2)
    time.sleep(1.5)
    private.kill()
    for i in range(4):  # load-only routing on last-known workers
        out = collect(stub, _req(f"Redis is down, request {i}:", 4), timeout_s=30)
        assert len(out["samples"][0]["token_ids"]) == 4
        time.sleep(0.3)
    assert "routing on last-known workers" in log_text(cluster.tmp, "gateway")
    private.start()
    client = redis.Redis.from_url(private.url)
    ids = [worker.env["TANDEM_WORKER_ID"] for worker in cluster.workers.values()]

    def unregistered() -> list[str]:
        return [i for i in ids if not list(client.scan_iter(match=f"tandem:*:worker:{i}"))]

    # Every worker, not the first one back: the next test kills the one serving its stream and
    # needs the other one routable (it once started with a single decode worker registered).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and unregistered():
        time.sleep(0.2)
    assert not unregistered(), f"workers did not re-register: {unregistered()}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "Redis reachable again" not in log_text(cluster.tmp, "gateway"):
        time.sleep(0.2)
    assert "Redis reachable again" in log_text(cluster.tmp, "gateway")
    time.sleep(1.0)  # two of the gateway's registry reads (every 0.5 s) after the last worker came back
    out = collect(stub, _req("Redis is back:", 4))
    assert len(out["samples"][0]["token_ids"]) == 4


def test_killed_decode_worker_fails_its_unresumable_stream_others_keep_flowing(env):
    """An unseeded sampled stream cannot be resumed on another decode worker (greedy and seeded
    ones are: test_failover.py): its worker's death ends it with UNAVAILABLE."""
    cluster, stub = env
    outcome: dict = {}
    got_tokens = threading.Event()
    sampled = gateway_pb2.GenerateRequest(prompt="Write a long poem about the ocean.",
                                          sampling=SP(max_tokens=500, temperature=0.8, ignore_eos=True))

    def victim() -> None:
        try:
            for message in stub.Generate(sampled, timeout=120):
                if message.token_ids:
                    got_tokens.set()
            outcome["code"] = "OK"
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()

    thread = threading.Thread(target=victim)
    thread.start()
    assert got_tokens.wait(60)
    time.sleep(0.3)
    holder = next(name for name, w in cluster.workers.items()
                  if name.startswith("decode") and stats(cluster, w.address, "decode").num_running > 0)
    worker = cluster.workers[holder]
    worker.proc.send_signal(signal.SIGKILL)
    thread.join(30)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    for i in range(4):  # the dead worker stays listed until its TTL: Admit fails, retried transparently
        out = collect(stub, _req(f"After the crash, request {i}:", 4), timeout_s=30)
        assert len(out["samples"][0]["token_ids"]) == 4
    client = redis.Redis.from_url(cluster.private_redis.url)
    worker_id = worker.env["TANDEM_WORKER_ID"]
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline and list(client.scan_iter(match=f"tandem:*:worker:{worker_id}*")):
        time.sleep(0.2)
    assert not list(client.scan_iter(match=f"tandem:*:worker:{worker_id}*")), "dead worker's keys did not expire"
