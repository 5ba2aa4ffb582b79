"""A prefill's timeout follows the work asked for: through a real gateway in front of a real
worker pair, a prompt whose prefill takes several times ``hop_timeout_s`` succeeds on its
first try, with no worker failure counted, and the gateway measures the worker's pace. And a
prefill whose worker the health probe finds down is not waited for up to that timeout: it
fails over at the verdict."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from cluster.registry import Role
from gateway import metrics
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from gateway.static_cluster import static_worker_id
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import gateway_over, pair

pytestmark = pytest.mark.slow
HOP_TIMEOUT_S = 0.5


def _failures() -> float:
    return sum(metrics.WORKER_FAILURES.labels(stage)._value.get() for stage in ("Admit", "Prefill", "Decode"))


def test_a_long_prompt_outlasts_the_hop_timeout_without_a_retry(engines):
    rng = random.Random(7)

    async def main():
        async with pair(engines) as p:
            settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True,
                                       static_prefill=[p.prefill.address], static_decode=[p.decode.address],
                                       refresh_interval_s=0.1, local_prefill_max_tokens=0,
                                       hop_timeout_s=HOP_TIMEOUT_S, max_retries=0)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    for _ in range(2):  # before the pace is measured, and after
                        prompt = [rng.randrange(1000, 40000) for _ in range(900)]
                        failures, started = _failures(), time.monotonic()
                        messages = [m async for m in stub.Generate(gateway_pb2.GenerateRequest(
                            token_ids=gateway_pb2.TokenIds(ids=prompt),
                            sampling=gateway_pb2.SamplingParams(max_tokens=1, temperature=0)), timeout=300)]
                        took = time.monotonic() - started
                        assert messages[-1].usage.prompt_tokens == 900 and messages[-1].usage.completion_tokens == 1
                        assert took > 2 * HOP_TIMEOUT_S, f"the prefill took {took:.2f} s: too short to test"
                        assert _failures() == failures
                    allowed = gateway.orchestrator.pace.timeout_s(static_worker_id(Role.PREFILL, p.prefill.address), 900)
                    assert allowed != HOP_TIMEOUT_S + 900 * settings.prefill_timeout_s_per_token  # measured
                    assert allowed > took  # with room to spare
            finally:
                await gateway.stop(grace_s=1)

    asyncio.run(main())


def test_a_prefill_fails_over_as_soon_as_the_probe_finds_its_worker_down(engines):
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 40000) for _ in range(900)]  # 8 steps of the prefill engine's budget

    async def main():
        async with gateway_over(engines, hop_timeout_s=600, max_retries=1, health_probe_interval_s=600) \
                as (p, gateway, address):
            start = await p.prefill.engine.num_free_blocks()
            retries, local = metrics.RETRIES._value.get(), metrics.PREFILLS.labels("local", "none")._value.get()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                call = stub.Generate(gateway_pb2.GenerateRequest(
                    token_ids=gateway_pb2.TokenIds(ids=prompt),
                    sampling=gateway_pb2.SamplingParams(max_tokens=2, temperature=0)), timeout=300)
                replies = asyncio.ensure_future(_all(call))
                while p.prefill.engine.stats().num_running == 0:  # the prefill worker has begun
                    assert not replies.done(), "the request ended before its prefill began"
                    await asyncio.sleep(0.005)
                prefill_id = static_worker_id(Role.PREFILL, p.prefill.address)
                assert gateway.view.outliers.probe_failed(prefill_id)  # the verdict a frozen worker gets
                messages = await replies
            assert sum(len(m.token_ids) for m in messages) == 2 and messages[-1].usage.prompt_tokens == 900
            assert metrics.RETRIES._value.get() == retries + 1  # the 600 s timeout was not waited for
            assert metrics.PREFILLS.labels("local", "none")._value.get() == local + 1  # the decode worker prefilled
            deadline = time.monotonic() + 30
            while await p.prefill.engine.num_free_blocks() != start:  # the abandoned prefill's blocks come back
                assert time.monotonic() < deadline, "the prefill worker kept the abandoned prefill's blocks"
                await asyncio.sleep(0.05)

    asyncio.run(main())


async def _all(call) -> list:
    return [m async for m in call]
