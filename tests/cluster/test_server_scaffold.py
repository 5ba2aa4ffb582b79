"""What every Tandem server's scaffold does for callers it does not trust: bytes that do not parse
get INVALID_ARGUMENT with a generic message (unary and streaming methods), reflection is served
only when enabled, and /metrics binds the listen host."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from prometheus_client import CollectorRegistry

from cluster.health import SERVING
from cluster.interceptors import MALFORMED_MESSAGE
from cluster.server import ServerScaffold, serve_metrics
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
