"""Tenants through a real gateway in front of a real worker pair (all on loopback, no Redis):
API keys are checked, each tenant's prefix cache is its own (no cached tokens reported across
tenants), and a tenant's concurrent calls are capped."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.auth import hash_key
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import pair

pytestmark = pytest.mark.slow

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob"}
# Long enough to fill several blocks of 16 tokens.
PROMPT = "My PIN is 4711. " + " ".join(f"Sentence {i} of a long shared preamble." for i in range(12))


def auth(tenant: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


async def generate(stub, tenant: str, max_tokens: int = 2) -> gateway_pb2.Usage:
    usage = None
    async for msg in stub.Generate(gateway_pb2.GenerateRequest(
            prompt=PROMPT, sampling=gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True)), metadata=auth(tenant)):
        if msg.HasField("usage"):
            usage = msg.usage
    return usage


def test_tenants_are_authenticated_isolated_and_limited(engines):
    async def main():
        async with pair(engines) as p:
            entries = [f"{hash_key(KEYS['alice'])}:alice", f"{hash_key(KEYS['bob'])}:bob:1"]
            settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True,
                                       static_prefill=[p.prefill.address],
                                       static_decode=[p.decode.address], api_keys=entries, refresh_interval_s=0.1,
                                       local_prefill_max_tokens=0)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                    assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a key
                    for metadata in ((), (("authorization", "Bearer wrong"),), (("x-api-key", "key-of-alic"),)):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=metadata)
                        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

                    first = await generate(stub, "alice")
                    again = await generate(stub, "alice")
                    other = await generate(stub, "bob")
                    assert first.cached_prompt_tokens == 0
                    assert again.cached_prompt_tokens >= 16 * ((first.prompt_tokens - 1) // 16)  # shared within
                    assert other.cached_prompt_tokens == 0  # nothing across tenants
                    assert (await generate(stub, "bob")).cached_prompt_tokens > 0

                    # bob may have one call in flight
                    running = asyncio.create_task(generate(stub, "bob", max_tokens=200))
                    while not gateway.frontend.admission.in_flight:
                        await asyncio.sleep(0.01)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await generate(stub, "bob")
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "bob" in err.value.details()
                    assert (await generate(stub, "alice")).prompt_tokens == first.prompt_tokens  # others unaffected
                    assert (await running).completion_tokens == 200
            finally:
                await gateway.stop(grace_s=1)

    asyncio.run(main())


def test_reflection_and_health_do_not_count_against_a_tenants_stream_limit(engines):
    """grpcurl keeps its reflection stream open while it calls: a tenant limited to one stream
    still generates; health needs no key at all."""
    from protos.grpc.reflection.v1 import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with pair(engines) as p:
            settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True,
                                       static_prefill=[p.prefill.address], static_decode=[p.decode.address],
                                       api_keys=[f"{hash_key(KEYS['bob'])}:bob:1"], refresh_interval_s=0.1)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        metadata=auth("bob"))
                    await reflection.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                    assert (await reflection.read()).list_services_response.service  # the stream is open
                    health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                    assert (await health.read()).status == health_pb2.HealthCheckResponse.SERVING
                    usage = await generate(gateway_pb2_grpc.GatewayStub(channel), "bob")
                    assert usage.completion_tokens == 2
                    reflection.cancel()
                    health.cancel()
            finally:
                await gateway.stop(grace_s=1)

    asyncio.run(main())
