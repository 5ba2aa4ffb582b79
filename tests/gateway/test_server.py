"""The gateway server as an outside client sees it: health that tells the truth (NOT_SERVING
until a request can be routed; on the probe port, liveness apart from it), ``Health/List``,
watch streams that end on drain instead of holding it, and reflection v1 and v1alpha that list the services and carry the proto
comments (what ``grpcurl describe`` shows)."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from google.protobuf import descriptor_pb2

from cli.launcher import free_port
from cluster.health import LIVENESS
from cluster.registry import WorkerConfig
from engine.block_hash import hash_seed
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc
from protos.grpc.reflection.v1 import reflection_pb2 as v1, reflection_pb2_grpc as v1_grpc
from protos.grpc.reflection.v1alpha import reflection_pb2 as v1alpha, reflection_pb2_grpc as v1alpha_grpc
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.gateway import ServerThread, register_workers
from tests.helpers.shared_redis import delete_keys

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def gateway(redis_url):
    prefix = f"test-server-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, health_port=free_port(), insecure=True,
                               redis_url=redis_url, redis_key_prefix=prefix,
                               registry_ttl_s=3600, refresh_interval_s=0.1)
    model = load_served_model(settings)
    config = WorkerConfig(model.model_id, 16, 2048, "float32", hash_seed(model.model_id, 16, "float32"), 49152)
    with ServerThread(Gateway(settings, model)) as server:
        server.prefix, server.config, server.health_port = prefix, config, settings.health_port
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            server.channel = channel
            yield server
    delete_keys(redis_url, prefix)


def wait_status(health, status: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while health.Check(health_pb2.HealthCheckRequest(), timeout=2).status != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.05)


def test_not_serving_until_a_request_can_be_routed(gateway, redis_url):
    health = health_pb2_grpc.HealthStub(gateway.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == NOT_SERVING
    with pytest.raises(grpc.RpcError) as info:
        gateway_pb2_grpc.GatewayStub(gateway.channel).GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    register_workers(redis_url, gateway.prefix, gateway.config, roles=("prefill",))
    time.sleep(0.5)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == NOT_SERVING  # no decode worker
    register_workers(redis_url, gateway.prefix, gateway.config, roles=("decode",))
    wait_status(health, SERVING)  # a decode worker alone serves (it prefills locally)
    statuses = health.List(health_pb2.HealthListRequest(), timeout=2).statuses
    assert {name: s.status for name, s in statuses.items()} == {"": SERVING, "tandem.v1.Gateway": SERVING,
                                                                    "inference.GRPCInferenceService": SERVING}


def test_the_probe_port_tells_liveness_apart_from_readiness(gateway, redis_url):
    """Kubernetes' grpc probes (no TLS) ask the probe port: ``liveness`` is SERVING while the
    gateway runs, even with no worker to route to (a liveness probe must not restart it then);
    ``""`` follows readiness, as on the API port."""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.health_port}") as channel:
        probe = health_pb2_grpc.HealthStub(channel)
        assert probe.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=2).status == SERVING
        assert probe.Check(health_pb2.HealthCheckRequest(), timeout=2).status == NOT_SERVING
        register_workers(redis_url, gateway.prefix, gateway.config)
        wait_status(probe, SERVING)
        assert probe.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Gateway"), timeout=2).status == SERVING


def test_a_watch_stream_ends_on_drain_instead_of_holding_it(gateway):
    health = health_pb2_grpc.HealthStub(gateway.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    assert next(watch).status == NOT_SERVING  # no workers registered: not routable
    started = time.monotonic()
    gateway.call(lambda: gateway.gateway.stop(grace_s=30))
    assert time.monotonic() - started < 5, "the drain waited for the watch stream"
    assert [m.status for m in watch] == []  # the stream ended cleanly (nothing after NOT_SERVING)


@pytest.mark.parametrize("pb2,grpc_module", [(v1, v1_grpc), (v1alpha, v1alpha_grpc)], ids=["v1", "v1alpha"])
def test_reflection_lists_services_and_describes_fields_with_their_comments(gateway, pb2, grpc_module):
    stub = grpc_module.ServerReflectionStub(gateway.channel)
    requests = [pb2.ServerReflectionRequest(list_services=""),
                pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.SamplingParams"),
                pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol")]
    listed, described, missing = list(stub.ServerReflectionInfo(iter(requests), timeout=30))
    names = {s.name for s in listed.list_services_response.service}
    assert {"tandem.v1.Gateway", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    gateway_file = next(f for f in files if f.package == "tandem.v1")
    comments = " ".join(loc.leading_comments for loc in gateway_file.source_code_info.location)
    assert "Makes the samples reproducible" in comments and "max_stop_token_ids" in comments
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("request_id", ["x" * 129, "a\nb INFO forged line"])
def test_request_id_is_capped_in_length_and_charset(gateway, request_id):
    with pytest.raises(grpc.RpcError) as info:
        list(gateway_pb2_grpc.GatewayStub(gateway.channel).Generate(
            gateway_pb2.GenerateRequest(request_id=request_id, prompt="hi"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request_id") and request_id not in info.value.details()


def test_malformed_request_is_invalid_argument_with_a_generic_message(gateway):
    generate = gateway.channel.unary_stream("/tandem.v1.Gateway/Generate", request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        list(generate(b"\xff\xff\xff\xff", timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Error" not in info.value.details() and "class" not in info.value.details()


class _SilentWorker(grpc.GenericRpcHandler):
    """A worker that answers its health probe SERVING and never answers anything else."""

    def service(self, handler_call_details):
        if handler_call_details.method == "/grpc.health.v1.Health/Check":
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: health_pb2.HealthCheckResponse(status=SERVING),
                request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString)

        def hang(request, context):
            while context.is_active():
                time.sleep(0.05)
            return b""

        return grpc.unary_unary_rpc_method_handler(hang)


def test_a_deadline_that_passes_in_the_gateway_is_counted_as_deadline_exceeded(gateway, redis_url):
    """A worker that never answers holds the request until the client's deadline: every such
    call ends DEADLINE_EXCEEDED, in the client's status and in the gateway's metrics (gRPC
    cancels the handler at a deadline too: not CANCELLED)."""
    from concurrent.futures import ThreadPoolExecutor

    from gateway import metrics

    silent = grpc.server(ThreadPoolExecutor(8), handlers=[_SilentWorker()])
    port = silent.add_insecure_port("127.0.0.1:0")
    silent.start()
    try:
        register_workers(redis_url, gateway.prefix, gateway.config, address=f"127.0.0.1:{port}")
        wait_status(health_pb2_grpc.HealthStub(gateway.channel), SERVING)
        counted = {code: metrics.REQUESTS.labels(code)._value.get() for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
        stub = gateway_pb2_grpc.GatewayStub(gateway.channel)
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=0.5))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while metrics.REQUESTS.labels("DEADLINE_EXCEEDED")._value.get() < counted["DEADLINE_EXCEEDED"] + 4:
            assert time.monotonic() < deadline, {k: v._value.get() for k, v in metrics.REQUESTS._metrics.items()}
            time.sleep(0.05)
        assert metrics.REQUESTS.labels("CANCELLED")._value.get() == counted["CANCELLED"]
    finally:
        silent.stop(0)


def test_an_open_gateway_on_a_network_address_is_refused_unless_chosen(redis_url):
    """No API key and a listen address other than loopback: the gateway does not start, and
    says which settings open it; ``allow_open`` (or a key) does."""
    import asyncio

    from cluster.server import StartupError
    from gateway.auth import hash_key

    base = dict(metrics_port=0, insecure=True, redis_url=redis_url, redis_key_prefix=f"test-open-{uuid.uuid4().hex[:8]}")
    model = load_served_model(GatewaySettings(**base))
    with pytest.raises(StartupError) as info:
        asyncio.run(Gateway(GatewaySettings(listen="0.0.0.0:0", **base), model).start())
    for name in ("TANDEM_API_KEYS", "TANDEM_ALLOW_OPEN", "0.0.0.0:0"):
        assert name in str(info.value)
    for settings in (GatewaySettings(listen="0.0.0.0:0", allow_open=True, **base),
                     GatewaySettings(listen="0.0.0.0:0", api_keys=[f"{hash_key('k')}:t"], **base),
                     GatewaySettings(listen="127.0.0.1:0", **base)):
        with ServerThread(Gateway(settings, model)) as server:
            assert server.port
