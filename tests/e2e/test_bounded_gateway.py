"""The gateway under a burst of large prompts, real processes (one decode worker that prefills
itself, a gateway): prompts over ``max_prompt_bytes`` are refused before tokenization, fast,
a small request sent in the middle of the burst is barely delayed, and the gateway's memory
comes back to within 1.5x of where it was."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, collect, shared_redis_cluster

pytestmark = pytest.mark.slow
LARGE_PROMPT = "hello world " * 333_000  # about 4 MB, under max_request_bytes (4 MiB)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    with shared_redis_cluster(tmp_path_factory.mktemp("bounded"), "bounded", redis_url, num_prefill=0, num_decode=1,
                              kv_transport="grpc") as cluster:
        yield cluster


def _small(stub) -> float:
    started = time.monotonic()
    out = collect(stub, gateway_pb2.GenerateRequest(prompt="Hi", sampling=SP(max_tokens=1, temperature=0)))
    assert len(out["samples"][0]["token_ids"]) == 1
    return time.monotonic() - started


def _large(stub) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        collect(stub, gateway_pb2.GenerateRequest(prompt=LARGE_PROMPT, sampling=SP(max_tokens=1)), timeout_s=30)
        code, details = "OK", ""
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details()
    return code, details, time.monotonic() - started


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_8_large_prompts_are_refused_fast_barely_delay_a_1_token_request_and_free_their_memory(cluster):
    stub, gateway_pid = cluster.stub, cluster.gateway.proc.pid
    baseline = statistics.median(_small(stub) for _ in range(5))
    rss_before = _rss_bytes(gateway_pid)  # a gateway that has served small requests only
    for _ in range(3):
        with ThreadPoolExecutor(9) as pool:
            large = [pool.submit(_large, stub) for _ in range(8)]
            time.sleep(0.05)  # the small request arrives while the large ones are being received and checked
            small = pool.submit(_small, stub)
            outcomes = [f.result() for f in large]
            delayed = small.result()
            assert all(code == "INVALID_ARGUMENT" and details.startswith("prompt:")
                       for code, details, _ in outcomes), outcomes
            assert max(seconds for _, _, seconds in outcomes) < 3.0, outcomes
            # Not queued behind the burst (which tokenizing 4 MB prompts would take tens of
            # seconds to clear); 2 s of margin: a full run beside another cluster's benchmark on
            # 2 cores measured 1.04 s.
            assert delayed < baseline + 2.0, (delayed, baseline)
    # The heap is trimmed once the burst is over (a second without a large request, then a task
    # of the event loop's executor): on busy cores that can take a few seconds, so the memory is
    # awaited, not read once.
    deadline = time.monotonic() + 15
    while _rss_bytes(gateway_pid) > 1.5 * rss_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rss_bytes(gateway_pid) <= 1.5 * rss_before, (rss_before, _rss_bytes(gateway_pid))
    with pytest.raises(grpc.RpcError) as info:  # Tokenize has the same cap
        stub.Tokenize(gateway_pb2.TokenizeRequest(prompt=LARGE_PROMPT), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
