"""One request's trace across real processes: a gateway, a prefill worker and decode workers
(the e2e LocalCluster, TLS between them) export over OTLP/gRPC to a receiver this test runs on
loopback; the request's spans share one trace id, come from all three processes, and link parent
to child across each hop; a stream whose decode worker is killed mid-stream and resumed on the
other one stays one trace, with the lost decode, the resume and the new decode in it."""

from __future__ import annotations

import os
import time

import pytest

from protos.tandem.v1 import gateway_pb2

from tests.helpers.cluster import EXACT_RESUME, SP, collect, shared_redis_cluster, stream_killing_its_decode_worker
from tests.helpers.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

SERVICES = {"tandem-gateway", "tandem-prefill", "tandem-decode"}


def otlp_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s, not the default 5 s


def request_spans(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    """The spans of the trace whose root (the gateway's Generate span) carries ``request_id``."""
    roots = [s for s in spans if s.attributes.get("tandem.request_id") == request_id and not s.parent_id]
    return [s for s in spans if roots and s.trace_id == roots[0].trace_id]


def test_one_trace_spans_gateway_prefill_and_decode_processes(tmp_path, redis_url):
    with OtlpReceiver() as receiver:
        with shared_redis_cluster(tmp_path, "tracing", redis_url, num_prefill=1, num_decode=1,
                                  kv_transport="grpc", env=otlp_env(receiver)) as cluster:
            prompt = " ".join(f"Sentence {i} of a prompt that fills a few blocks." for i in range(8))
            result = collect(cluster.stub, gateway_pb2.GenerateRequest(
                request_id="e2e-traced", prompt=prompt, sampling=SP(max_tokens=4, temperature=0, ignore_eos=True)))
            assert result["usage"].completion_tokens == 4

            def complete(spans):  # every process's spans, each process exporting on its own schedule
                names = {s.name for s in request_spans(spans, "e2e-traced")}
                return {"tandem.v1.DecodeWorker/Decode", "tandem.v1.DecodeWorker/TransferKV", "decode",
                        "tandem.v1.PrefillWorker/Prefill", "kv_transfer"} <= names

            receiver.wait_for(complete, timeout_s=30)
            time.sleep(1.0)  # ten export rounds: an Abort sent after the stream ended would be in by now
            spans = request_spans(receiver.spans(), "e2e-traced")

    assert {s.service for s in spans} == SERVICES
    # the decode worker finished the request: the gateway sends it no Abort (it once did, every request)
    assert not [s.name for s in spans if s.name.endswith("/Abort")]
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


def test_a_stream_resumed_after_its_decode_worker_is_killed_is_one_trace_showing_the_failover(tmp_path, redis_url):
    """1 prefill + 2 decode workers; a greedy stream's decode worker is SIGKILLed once the client
    has 4 of its 64 tokens; the gateway resumes it on the other decode worker (the client gets
    what an undisturbed run gets). The trace: the lost ``decode`` span ERROR with the Decode
    call's status and the lost worker, a ``resume`` span naming the lost worker and why, a new
    ``attempt`` on the other worker, and a second ``decode`` that ends well. What the killed
    worker exported before it died is not looked at (its spans in flight are never exported)."""
    with OtlpReceiver() as receiver:
        with shared_redis_cluster(tmp_path, "tracing-failover", redis_url, num_prefill=1, num_decode=2,
                                  kv_transport="grpc", env={**otlp_env(receiver), **EXACT_RESUME}) as cluster:
            request = gateway_pb2.GenerateRequest(request_id="e2e-reference",
                                                  prompt="Tell a long story about a lighthouse keeper.",
                                                  sampling=SP(max_tokens=64, temperature=0, ignore_eos=True))
            reference = collect(cluster.stub, request)["samples"][0]
            request.request_id = "e2e-failover"
            seen = stream_killing_its_decode_worker(cluster, request, after_tokens=4)
            token_ids, text, finish, usage, victim, tokens_at_kill = (
                seen.token_ids, seen.text, seen.finish, seen.usage, seen.victim, seen.tokens_at_kill)
            assert seen.code == "OK"
            assert (token_ids, text, finish) == (reference["token_ids"], reference["text"], reference["finish"])
            assert usage.completion_tokens == len(token_ids) == 64
            # The launcher's worker ids: "<name>-<the launching process's pid>".
            lost_id = f"{victim}-{os.getpid()}"
            (survivor,) = {name for name in cluster.workers if name.startswith("decode")} - {victim}
            survivor_id = f"{survivor}-{os.getpid()}"

            def complete(spans):  # the survivor's Admit too: each process exports on its own schedule
                mine = request_spans(spans, "e2e-failover")
                names = [s.name for s in mine]
                resumed_attempts = {s.span_id for s in mine if s.name == "attempt"
                                    and s.attributes.get("tandem.decode_worker") == survivor_id}
                return names.count("decode") == 2 and "resume" in names and "tandem.v1.Gateway/Generate" in names \
                    and "tandem.v1.DecodeWorker/Decode" in names and "tandem.v1.PrefillWorker/Prefill" in names \
                    and any(s.name == "tandem.v1.DecodeWorker/Admit" and s.parent_id in resumed_attempts for s in mine)

            everything = receiver.wait_for(complete, timeout_s=30)
            spans = request_spans(everything, "e2e-failover")

    assert complete(everything), sorted(s.name for s in spans)
    # One trace: every span of the request's worker calls (both tries' Admit, Prefill, Decode:
    # "e2e-failover-<hex>") is in it.
    assert {s.trace_id for s in everything
            if str(s.attributes.get("tandem.request_id", "")).startswith("e2e-failover")} == {spans[0].trace_id}
    assert {s.service for s in spans} == SERVICES
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_id in by_id for s in spans if s.parent_id)  # no span's parent went missing
    named = {}
    for s in spans:
        named.setdefault(s.name, []).append(s)
    (generate,) = named["tandem.v1.Gateway/Generate"]
    assert generate.status == "UNSET"
    assert [s.attributes["tandem.decode_worker"] for s in named["attempt"]
            if by_id[s.parent_id].name == "first_token"] == [lost_id]

    def children(span: ReceivedSpan, name: str) -> list[ReceivedSpan]:
        return [s for s in spans if s.parent_id == span.span_id and s.name == name]

    lost = [s for s in named["decode"] if s.attributes["tandem.decode_worker"] == lost_id]
    resumed = [s for s in named["decode"] if s.attributes["tandem.decode_worker"] == survivor_id]
    assert len(lost) == len(resumed) == 1, [(s.attributes, s.status) for s in named["decode"]]
    assert lost[0].parent_id == resumed[0].parent_id == generate.span_id
    assert lost[0].status == "ERROR"
    assert "UNAVAILABLE" in lost[0].status_message and lost_id in lost[0].status_message, lost[0].status_message

    (resume,) = named["resume"]
    assert resume.parent_id == generate.span_id
    assert resume.status == "UNSET"
    assert resume.attributes["tandem.resume"] == 1
    assert resume.attributes["tandem.lost_worker"] == lost_id
    assert "UNAVAILABLE" in resume.attributes["tandem.lost_reason"], resume.attributes
    assert tokens_at_kill <= resume.attributes["tandem.tokens_sent"] < 64
    (attempt,) = children(resume, "attempt")
    assert attempt.attributes["tandem.decode_worker"] == survivor_id and attempt.status == "UNSET"
    (admit,) = children(attempt, "tandem.v1.DecodeWorker/Admit")
    assert admit.service == "tandem-decode" and admit.status == "UNSET"

    # The resumed decode ends well (OpenTelemetry leaves a span that ends well UNSET, not OK).
    assert resumed[0].status == "UNSET" and resumed[0].attributes["tandem.output_tokens"] == 64
    (decode_call,) = children(resumed[0], "tandem.v1.DecodeWorker/Decode")
    assert decode_call.service == "tandem-decode" and decode_call.status == "UNSET"
