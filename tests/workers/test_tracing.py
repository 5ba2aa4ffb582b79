"""OpenTelemetry traces through a real gateway in front of a real worker pair (one process, the
SDK's in-memory exporter): one trace per request with the spans of every hop linked parent to
child, request id and tenant as attributes and no prompt text, each failed try visible, a decode
stream lost mid-stream visible with its status and the resume that follows it; and, with the
standard variables unset, tracing stays off without loading the tracing SDK."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cluster import tracing
from cluster.registry import Role
from gateway.auth import hash_key
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from gateway.static_cluster import static_worker_id
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import pair

pytestmark = pytest.mark.slow

KEY = "key-of-carol"
SECRET_WORD = "Quixotically"
# About 300 tokens: three chunks of the prefill engine's 128-token budget.
PROMPT = f"{SECRET_WORD} speaking, " + " ".join(f"sentence {i} of a long preamble." for i in range(40))


@pytest.fixture
def spans():
    """Tracing on for the test, into an in-memory exporter (the servers are built inside)."""
    exporter = InMemorySpanExporter()
    tracing.enable("tandem-test", SimpleSpanProcessor(exporter))
    yield exporter
    tracing.shutdown()


def by_name(finished) -> dict[str, list]:
    names: dict[str, list] = {}
    for span in finished:
        names.setdefault(span.name, []).append(span)
    return names


def _gateway_settings(p) -> GatewaySettings:
    """A plaintext gateway in front of pair ``p``'s workers, tenant ``carol`` by :data:`KEY`,
    never prefilling on the decode worker, retrying twice."""
    return GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True,
                           static_prefill=[p.prefill.address], static_decode=[p.decode.address],
                           api_keys=[f"{hash_key(KEY)}:carol"], refresh_interval_s=0.1,
                           local_prefill_max_tokens=0, max_retries=2)


def test_one_request_is_one_trace_across_gateway_prefill_transfer_and_decode(engines, spans):
    async def main():
        async with pair(engines) as p:
            settings = _gateway_settings(p)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    request = gateway_pb2.GenerateRequest(
                        request_id="traced-1", prompt=PROMPT,
                        sampling=gateway_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                    async for _ in stub.Generate(request, metadata=(("x-api-key", KEY),)):
                        pass
                    ok = list(spans.get_finished_spans())
                    spans.clear()
                    p.decode.server.servicer.admission.open = False  # every Admit now fails UNAVAILABLE
                    request.request_id = "traced-2"
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(request, metadata=(("x-api-key", KEY),), timeout=60):
                            pass
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                    failed = list(spans.get_finished_spans())
                block_nbytes = p.prefill.server.servicer.layout.block_nbytes
            finally:
                await gateway.stop(grace_s=1)
        return ok, failed, block_nbytes

    ok, failed, block_nbytes = asyncio.run(main())

    assert len({s.context.trace_id for s in ok}) == 1  # one trace; the health probes start none
    spans_named = by_name(ok)
    one = {name: found[0] for name, found in spans_named.items() if len(found) == 1}
    generate = one["tandem.v1.Gateway/Generate"]
    assert generate.parent is None
    assert generate.attributes["tandem.request_id"] == "traced-1"
    assert generate.attributes["tandem.tenant"] == "carol"

    def parent(name: str):
        span = one[name]
        return next(s for s in ok if s.context.span_id == span.parent.span_id).name

    assert parent("validate_and_tokenize") == "tandem.v1.Gateway/Generate"
    assert parent("first_token") == "tandem.v1.Gateway/Generate"
    assert parent("route") == parent("attempt") == "first_token"
    assert parent("tandem.v1.DecodeWorker/Admit") == "attempt"
    assert parent("tandem.v1.PrefillWorker/Prefill") == "attempt"
    assert parent("kv_transfer") == "tandem.v1.PrefillWorker/Prefill"
    assert parent("tandem.v1.DecodeWorker/TransferKV") == "kv_transfer"
    assert parent("decode") == "tandem.v1.Gateway/Generate"
    assert parent("tandem.v1.DecodeWorker/Decode") == "decode"
    chunks = spans_named["prefill_chunk"]
    assert len(chunks) >= 3
    assert {c.parent.span_id for c in chunks} == {one["tandem.v1.PrefillWorker/Prefill"].context.span_id}
    transfer = one["kv_transfer"].attributes
    assert transfer["tandem.kv.transport"] in ("grpc", "nixl")
    assert transfer["tandem.kv.bytes"] == transfer["tandem.kv.blocks"] * block_nbytes > 0
    assert one["tandem.v1.PrefillWorker/Prefill"].attributes["tandem.request_id"].startswith("traced-1-")
    assert one["decode"].attributes["tandem.output_tokens"] == 4
    assert "retry" not in spans_named
    assert not any(SECRET_WORD in str(value) for s in ok for value in s.attributes.values())

    # The failed request: the first try and each retry, each marked ERROR, with its worker's span
    failed_named = by_name(failed)
    tries = failed_named["attempt"] + failed_named["retry"]
    assert [t.attributes["tandem.retries"] for t in tries] == [0, 1, 2]
    assert all(t.status.status_code.name == "ERROR" and t.status.description.startswith("Admit: UNAVAILABLE ")
               for t in tries), [t.status.description for t in tries]
    admits = failed_named["tandem.v1.DecodeWorker/Admit"]
    assert {s.parent.span_id for s in admits} == {t.context.span_id for t in tries}
    assert all(s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0] for s in admits)
    assert all(s.status.description.startswith("UNAVAILABLE: ") for s in admits), [s.status.description for s in admits]
    assert failed_named["tandem.v1.Gateway/Generate"][0].status.status_code.name == "ERROR"


def test_a_decode_stream_lost_mid_stream_is_marked_and_its_resume_names_the_lost_worker_and_why(engines, spans):
    """The decode worker stops (no drain time) after the client has 4 tokens: its stream ends
    UNAVAILABLE. The gateway's ``decode`` span is ERROR, described in words naming the worker
    and that status (no Python class name); a
    ``resume`` span (child of the request's span) names the lost worker, the reason and the
    tokens already sent, and holds the tries of the resume (which fail here: no other decode
    worker), so the request ends UNAVAILABLE. The e2e test resumes one for real."""
    async def main():
        async with pair(engines, drain_timeout_s=0.0) as p:
            settings = _gateway_settings(p)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                        request_id="traced-lost", prompt=PROMPT,
                        sampling=gateway_pb2.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)),
                        metadata=(("x-api-key", KEY),), timeout=60)
                    received = 0
                    while received < 4:
                        received += len((await call.read()).token_ids)
                    await p.decode.server.shutdown()  # no drain time: its streams end UNAVAILABLE
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        while await call.read() != grpc.aio.EOF:
                            pass
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                await gateway.stop(grace_s=1)
        return received, static_worker_id(Role.DECODE, p.decode.address)

    received, decode_id = asyncio.run(main())

    finished = list(spans.get_finished_spans())
    assert len({s.context.trace_id for s in finished}) == 1
    named = by_name(finished)
    (generate,) = named["tandem.v1.Gateway/Generate"]
    (lost,) = named["decode"]  # the resume found no decode worker to go on with
    assert lost.parent.span_id == generate.context.span_id
    assert lost.status.status_code.name == "ERROR"
    assert lost.status.description.startswith(f"decode worker {decode_id} failed mid-stream: UNAVAILABLE "), \
        lost.status.description
    (resume,) = named["resume"]
    assert resume.parent.span_id == generate.context.span_id
    assert resume.attributes["tandem.resume"] == 1
    assert resume.attributes["tandem.lost_worker"] == decode_id
    assert "UNAVAILABLE" in resume.attributes["tandem.lost_reason"], resume.attributes
    assert received <= resume.attributes["tandem.tokens_sent"] < 200
    assert resume.status.status_code.name == "ERROR"
    tries = [s for s in named.get("attempt", []) + named.get("retry", []) if s.parent.span_id == resume.context.span_id]
    assert tries and all(t.status.status_code.name == "ERROR" for t in tries)
    assert generate.status.status_code.name == "ERROR"


@pytest.mark.parametrize("environ, on", [({}, False), ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, True),
                                         ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                           "OTEL_SDK_DISABLED": "true"}, False)])
def test_tracing_is_off_without_the_standard_variables_and_loads_no_tracing_sdk(environ, on):
    script = ("import sys\n"
              "from cluster import tracing\n"
              "import gateway.server, prefill_worker.server, decode_worker.server\n"
              "from cluster.channels import ChannelCache\n"
              "print(tracing.configure('tandem-gateway'), tracing.span('a') is tracing.span('b'),\n"
              "      len(ChannelCache()._interceptors) > 0, any(m.startswith(('opentelemetry.sdk.trace',\n"
              "      'opentelemetry.exporter', 'opentelemetry.propagate')) for m in sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", script], env={**env, **environ}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ([str(on), str(not on), str(on), str(on)])
