"""The local cluster with no Redis at all: fixed worker addresses and the gateway's in-process
prefix index still route a shared prefix to the prefill worker that computed it."""

from __future__ import annotations

import time

import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import SP, collect, free_blocks, gateway_stub, log_text, start_cluster, wait_free_blocks

pytestmark = pytest.mark.slow


def test_no_redis_serves_and_routes_shared_prefixes(tmp_path):
    cluster = start_cluster(tmp_path, "unused", None, num_prefill=2, num_decode=1, kv_transport="auto")
    try:
        assert "in-process prefix index" in log_text(tmp_path, "gateway")
        start = free_blocks(cluster)
        channel, stub = gateway_stub(cluster)
        with channel:
            for topic in ("astronomy", "cooking"):
                prefix = f"You are an expert on {topic}. " + " ".join(
                    f"Fact {i} about {topic} is important." for i in range(30))
                for question, min_cached in (("Question one?", 0), ("Question two, slightly different?", 160)):
                    # The gateway's view of the loads settles first (its refresh reads them every
                    # 0.5 s): on busy cores a reading taken while the previous request ran made
                    # the worker holding the prefix look loaded, and routing is by prefix and load.
                    time.sleep(1.5)
                    request = gateway_pb2.GenerateRequest(
                        prompt=f"{prefix} {question}", sampling=SP(max_tokens=2, temperature=0))
                    out = collect(stub, request)
                    assert out["samples"][0]["token_ids"], out
                    assert out["usage"].cached_prompt_tokens >= min_cached, (topic, question, out["usage"])
        assert wait_free_blocks(cluster, start, within_s=5) == start
    finally:
        cluster.stop()
