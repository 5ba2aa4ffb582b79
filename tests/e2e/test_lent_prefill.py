"""A decode worker of both roles end to end: a gateway and two decode workers as processes, with
mTLS, no prefill worker, the second decode worker also serving prefill
(``TANDEM_SERVES_PREFILL``). A request whose prefill on its own decode worker (which runs a
stream) would break its inter-token objective is prefilled on the other one, whose KV reaches
the request's decode worker by the transport under test; its answer equals the offline
engine's greedy answer token for token, and both workers' blocks return to their start."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.tls import TlsFiles, role_name
from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

from tests.helpers.cluster import SP, collect, settled_free_blocks, shared_redis_cluster, wait_free_blocks

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the workers' default
PREFIX = [(37 * i) % 30000 + 200 for i in range(10 * BLOCK_SIZE)]  # 10 full blocks


def suffix(seed: int) -> list[int]:
    return [(1000 * seed + 11 * i) % 30000 + 300 for i in range(20)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url, kv_transport):
    with shared_redis_cluster(tmp_path_factory.mktemp("lent"), "lent", redis_url, num_prefill=0, num_decode=2,
                              kv_transport=kv_transport,
                              worker_env={"decode-1": {"TANDEM_SERVES_PREFILL": "1"}}) as cluster:
        yield cluster


def prefills(cluster) -> dict[tuple[str, str], float]:
    """The gateway's ``tandem_gateway_prefills_total`` by (where, KV transport)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports['gateway']}/metrics", timeout=5) as page:
        text = page.read().decode()
    return {(s.labels["where"], s.labels["kv_transport"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "tandem_gateway_prefills_total"}


def cache_on_decode_0(cluster, prompt: list[int]) -> None:
    """Prefill ``prompt`` on decode-0 itself (Admit, then a one-token local-prefill Decode, with
    the gateway's certificate), so that its prefix cache, and the prefix index, hold it."""
    credentials = TlsFiles.load(cluster.tls_dir, "gateway", "tls_dir").channel_credentials()
    with grpc.secure_channel(cluster.workers["decode-0"].address, credentials,
                             options=[("grpc.ssl_target_name_override", role_name("decode"))]) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        admit = stub.Admit(worker_pb2.AdmitRequest(request_id="seed", prompt_token_ids=prompt), timeout=30)
        list(stub.Decode(worker_pb2.DecodeRequest(
            request_id="seed", reservation_id=admit.reservation_id, prompt_token_ids=prompt, local_prefill=True,
            sampling=SP(max_tokens=1, temperature=0)), timeout=60))


def generate(prompt: list[int], sampling, **slo) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling,
                                       slo=gateway_pb2.ServiceLevel(**slo))


def test_a_prompt_is_prefilled_on_the_lending_decode_worker_and_decoded_on_the_other(cluster, kv_transport):
    lent_prompt = PREFIX + suffix(3)
    offline = LLM(max_model_len=2048, kv_cache_memory_bytes=64 << 20)
    expected = offline.generate([lent_prompt], SamplingParams(max_tokens=16, temperature=0),
                                use_tqdm=False)[0].outputs[0].token_ids
    del offline
    before = settled_free_blocks(cluster, within_s=30)
    cache_on_decode_0(cluster, PREFIX)
    time.sleep(2.0)  # its blocks reach the prefix index (heartbeats every 0.5 s) and the gateway's view
    # A request routed to decode-0 by its prefix measures decode-0's prefill pace and step time.
    warm = collect(cluster.stub, generate(PREFIX + suffix(1), SP(max_tokens=4, temperature=0)))
    assert warm["usage"].cached_prompt_tokens == len(PREFIX), "not routed to decode-0, which holds the prefix"
    # A long stream keeps decode-0 busy: from now on a prefill there would stretch its steps.
    running = cluster.stub.Generate(generate(PREFIX + suffix(2), SP(max_tokens=900, temperature=0, ignore_eos=True)),
                                    timeout=300)
    next(running)
    time.sleep(2.0)  # the gateway counts it as running once a heartbeat has reported it

    def drain() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled below
            for _ in running:
                pass

    drained = threading.Thread(target=drain, daemon=True)
    drained.start()
    lent_before = sum(v for (where, _), v in prefills(cluster).items() if where == "lent")
    # The prefix routes it to decode-0; its 1 ms inter-token objective cannot be met there while
    # the stream runs, and decode-1 is idle: placement lends decode-1 the prompt.
    out = collect(cluster.stub, generate(lent_prompt, SP(max_tokens=16, temperature=0), itl_s=0.001))
    assert out["samples"][0]["token_ids"] == expected
    after = prefills(cluster)
    assert sum(v for (where, _), v in after.items() if where == "lent") == lent_before + 1
    assert after.get(("lent", kv_transport), 0) >= 1  # the KV went by the transport under test
    running.cancel()
    drained.join(30)
    assert wait_free_blocks(cluster, before, within_s=15) == before
