"""A gateway with TLS in front of a worker pair with mTLS (real servers on loopback, no Redis):
clients reach it over TLS only, and it serves requests through workers whose certificates match
their roles."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.tls import init_certs
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import pair

pytestmark = pytest.mark.slow


def test_gateway_serves_over_tls_through_mtls_workers(engines, tmp_path):
    init_certs(str(tmp_path))
    ca = (tmp_path / "ca.pem").read_bytes()

    async def main():
        async with pair(engines, tls_dir=str(tmp_path)) as p:
            settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, static_prefill=[p.prefill.address],
                                       static_decode=[p.decode.address], refresh_interval_s=0.1,
                                       local_prefill_max_tokens=0, tls_dir=str(tmp_path))
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            request = gateway_pb2.GenerateRequest(prompt="Name a prime number.",
                                                  sampling=gateway_pb2.SamplingParams(max_tokens=4, ignore_eos=True))
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await gateway_pb2_grpc.GatewayStub(plain).GetModelInfo(gateway_pb2.GetModelInfoRequest(),
                                                                              timeout=3)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                credentials = grpc.ssl_channel_credentials(root_certificates=ca)
                async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    while not gateway.view.routable:
                        await asyncio.sleep(0.05)
                    prefilled = engines[0].kv_manager.prefix_queries
                    tokens = [t async for m in stub.Generate(request) for t in m.token_ids]
                    assert len(tokens) == 4
                    # the prompt went through the prefill worker (a refused prefill worker would
                    # leave the decode worker to prefill it itself)
                    assert engines[0].kv_manager.prefix_queries > prefilled
            finally:
                await gateway.stop(grace_s=1)

    asyncio.run(main())
