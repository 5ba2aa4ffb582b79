"""What every Tandem server's scaffold does for callers it does not trust: bytes that do not parse
get INVALID_ARGUMENT with a generic message (unary and streaming methods), reflection is served
only when enabled, /metrics binds the listen host, and the plaintext probe port answers health
Check alone, beside a TLS-only API port."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from prometheus_client import CollectorRegistry

from cluster.health import LIVENESS, NOT_SERVING, SERVING
from cluster.interceptors import MALFORMED_MESSAGE
from cluster.server import BindError, ServerScaffold, serve_metrics
from cluster.tls import init_certs, server_credentials
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc
from protos.grpc.reflection.v1 import reflection_pb2, reflection_pb2_grpc

GARBAGE = b"\xff\xff\xff\xff"


async def _serve(reflection: bool) -> tuple[ServerScaffold, grpc.aio.Channel]:
    scaffold = ServerScaffold(["tandem.v1.Test"], reflection=reflection)
    port = scaffold.bind("127.0.0.1:0", "listen")
    await scaffold.start()
    await scaffold.health.set_all(SERVING)
    return scaffold, grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def raw(channel: grpc.aio.Channel, kind: str, method: str):
    return getattr(channel, kind)(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def test_malformed_requests_get_invalid_argument_with_a_generic_message():
    async def main():
        scaffold, channel = await _serve(reflection=True)
        try:
            calls = [
                raw(channel, "unary_unary", "/grpc.health.v1.Health/Check")(GARBAGE),
                _drain(raw(channel, "unary_stream", "/grpc.health.v1.Health/Watch")(GARBAGE)),
                _drain(raw(channel, "stream_stream", "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")(
                    iter([GARBAGE]))),
            ]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == MALFORMED_MESSAGE
            # well-formed calls still pass through the interceptor, unary and streaming
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            watch.cancel()
        finally:
            await channel.close()
            await scaffold.stop(0)

    asyncio.run(main())


async def _drain(call) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize("enabled", [True, False])
def test_reflection_is_served_only_when_enabled(enabled):
    async def main():
        scaffold, channel = await _serve(reflection=enabled)
        try:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            if enabled:
                response = await stub.ServerReflectionInfo(iter([request])).read()
                assert "tandem.v1.Test" in {s.name for s in response.list_services_response.service}
            else:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _drain(stub.ServerReflectionInfo(iter([request])))
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await channel.close()
            await scaffold.stop(0)

    asyncio.run(main())


def test_metrics_bind_the_listen_host_only():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = serve_metrics(CollectorRegistry(), "127.0.0.1", port, "metrics_port")
    try:
        assert server.server_address[:2] == ("127.0.0.1", port)
    finally:
        server.shutdown()


def test_the_probe_port_answers_check_in_plaintext_beside_a_tls_only_port(tmp_path):
    init_certs(str(tmp_path))

    async def main():
        scaffold = ServerScaffold(["tandem.v1.Test"], reflection=False)
        port = scaffold.bind("127.0.0.1:0", "listen", server_credentials(str(tmp_path), "decode", True, "tls_dir"))
        probe_port = scaffold.serve_probes("127.0.0.1", 0, "health_port")
        with pytest.raises(BindError, match="health_port"):  # a taken port is refused, naming the setting
            ServerScaffold(["tandem.v1.Test"], reflection=True).serve_probes("127.0.0.1", probe_port, "health_port")
        await scaffold.start()
        api, probes = grpc.aio.insecure_channel(f"127.0.0.1:{port}"), grpc.aio.insecure_channel(f"127.0.0.1:{probe_port}")
        try:
            def check(channel, service=""):
                return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=2)

            with pytest.raises(grpc.aio.AioRpcError) as err:  # what a kubelet grpc probe gets from a TLS port
                await check(api)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # the probe port: the server's statuses, and liveness SERVING whatever they are
            assert (await check(probes)).status == NOT_SERVING
            assert (await check(probes, LIVENESS)).status == SERVING
            await scaffold.health.set_all(SERVING)
            assert (await check(probes, "tandem.v1.Test")).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await check(probes, "no.such.Service")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            for method in ("List", "Watch"):  # Check alone: no streams held on a port open to every pod
                call = getattr(health_pb2_grpc.HealthStub(probes), method)(
                    health_pb2.HealthListRequest() if method == "List" else health_pb2.HealthCheckRequest(), timeout=2)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await (call if method == "List" else _drain(call))
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await scaffold.health.shutdown()  # a drain: liveness goes too
            assert (await check(probes, LIVENESS)).status == NOT_SERVING
        finally:
            await api.close()
            await probes.close()
            await scaffold.stop(0)

    asyncio.run(main())
