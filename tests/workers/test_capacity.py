"""Waiting for decode capacity, through a real gateway in front of a real worker pair: with the
decode worker's blocks reserved, a request waits up to ``admit_wait_s``; a client deadline that
passes first ends it DEADLINE_EXCEEDED, a wait that outlasts ``admit_wait_s`` (and no deadline)
RESOURCE_EXHAUSTED; no block stays held."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2

from tests.helpers.workers import gateway_over

pytestmark = pytest.mark.slow
ADMIT_WAIT_S = 4.0
DEADLINE_S = 2.0  # before the wait for capacity runs out


def test_a_deadline_that_passes_while_waiting_for_capacity_is_deadline_exceeded(engines):
    async def main():
        async with gateway_over(engines, admit_wait_s=ADMIT_WAIT_S) as (p, gateway, address):
            start = (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks())
            # 60 of the decode worker's 64 blocks, held until the reservation's 30 s lease ends.
            await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="hold", prompt_token_ids=range(1000, 1960)))
            request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=range(2000, 2100)),
                                                  sampling=gateway_pb2.SamplingParams(max_tokens=4, temperature=0))
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in stub.Generate(request, timeout=DEADLINE_S)]
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()

                with pytest.raises(grpc.aio.AioRpcError) as err:  # overload that outlasts the wait
                    [m async for m in stub.Generate(request, timeout=60)]
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
            await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id="hold"))
            assert (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks()) == start

    asyncio.run(main())
