"""One request's trace across real processes: a gateway, a prefill worker and a decode worker
(the e2e LocalCluster, TLS between them) export over OTLP/gRPC to a receiver this test runs on
loopback; the request's spans share one trace id, come from all three processes, and link parent
to child across each hop."""

from __future__ import annotations

import pytest

from protos.tandem.v1 import gateway_pb2

from .cluster_helpers import SP, collect, shared_redis_cluster
from .otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow

SERVICES = {"tandem-gateway", "tandem-prefill", "tandem-decode"}


def test_one_trace_spans_gateway_prefill_and_decode_processes(tmp_path, redis_url):
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s, not the default 5 s
        with shared_redis_cluster(tmp_path, "tracing", redis_url, num_prefill=1, num_decode=1,
                                  kv_transport="grpc", env=env) as cluster:
            prompt = " ".join(f"Sentence {i} of a prompt that fills a few blocks." for i in range(8))
            result = collect(cluster.stub, gateway_pb2.GenerateRequest(
                request_id="e2e-traced", prompt=prompt, sampling=SP(max_tokens=4, temperature=0, ignore_eos=True)))
            assert result["usage"].completion_tokens == 4

            def request_spans(spans):
                roots = [s for s in spans if s.attributes.get("tandem.request_id") == "e2e-traced" and not s.parent_id]
                return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

            def complete(spans):
                names = {s.name for s in request_spans(spans)}
                return {"tandem.v1.DecodeWorker/Decode", "tandem.v1.DecodeWorker/TransferKV", "decode"} <= names

            spans = request_spans(receiver.wait_for(complete, timeout_s=30))

    assert {s.service for s in spans} == SERVICES
    by_id = {s.span_id: s for s in spans}
    one = {s.name: s for s in spans}

    def parent(name: str) -> tuple[str, str]:
        span = by_id[one[name].parent_id]
        return span.service, span.name

    assert one["tandem.v1.Gateway/Generate"].service == "tandem-gateway"
    assert parent("tandem.v1.PrefillWorker/Prefill") == ("tandem-gateway", "attempt")
    assert parent("tandem.v1.DecodeWorker/Admit") == ("tandem-gateway", "attempt")
    assert parent("kv_transfer") == ("tandem-prefill", "tandem.v1.PrefillWorker/Prefill")
    assert parent("tandem.v1.DecodeWorker/TransferKV") == ("tandem-prefill", "kv_transfer")
    assert parent("tandem.v1.DecodeWorker/Decode") == ("tandem-gateway", "decode")
    assert one["kv_transfer"].attributes["tandem.kv.transport"] == "grpc"
    assert one["kv_transfer"].attributes["tandem.kv.bytes"] > 0
    assert all(s.parent_id in by_id for s in spans if s.parent_id)  # no span's parent went missing
