"""Placement through a real gateway in front of a real worker pair: a request placed on the
decode worker is prefilled there (no KV moves) and gets the same tokens as one prefilled on
the prefill worker; a request's own objectives override the gateway's; bad objectives are
refused naming the field; with its only prefill worker refusing work (draining), a request is
prefilled on the decode worker within its deadline; a prompt lent to another decode worker's
prefill service gets its KV to the request's decode worker and the same tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import grpc
import pytest

from cluster.registry import Role, WorkerInfo, WorkerLoad
from gateway import metrics
from gateway.placement import LENT, LOCAL_PREDICTED, REMOTE
from gateway.static_cluster import static_worker_id
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

from tests.helpers.workers import gateway_over

pytestmark = pytest.mark.slow
BACKLOG = 50_000  # prompt tokens queued on the prefill worker: 50 s at the pace set below


def _placements(kind: str) -> float:
    return metrics.PLACEMENTS.labels(kind)._value.get()


def _prefills(where: str) -> float:
    return sum(s.value for family in metrics.PREFILLS.collect() for s in family.samples
               if s.name.endswith("_total") and s.labels["where"] == where)


def _request(prompt: list[int], **slo) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), slo=gateway_pb2.ServiceLevel(**slo),
                                       sampling=gateway_pb2.SamplingParams(max_tokens=8, temperature=0))


def test_requests_are_placed_by_predicted_ttft_and_their_own_objectives(engines):
    prompt = [random.Random(3).randrange(1000, 40000) for _ in range(100)]

    async def main():
        async with gateway_over(engines) as (p, gateway, address):
            start = await p.decode.engine.num_free_blocks()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def generate(request) -> list[int]:
                    return [t for m in await asyncio.wait_for(_collect(stub, request), 120) for t in m.token_ids]

                for code, field in ((-1.0, "slo.ttft_s"), (float("nan"), "slo.ttft_s")):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await generate(_request(prompt, ttft_s=code))
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert field in refused.value.details()
                with pytest.raises(grpc.aio.AioRpcError, match="slo.itl_s"):
                    await generate(_request(prompt, itl_s=float("inf")))
                with pytest.raises(grpc.aio.AioRpcError, match="slo.tpot_s"):
                    await generate(_request(prompt, tpot_s=-0.02))

                remote = _placements(REMOTE)
                disaggregated = await generate(_request(prompt))  # paces not measured yet: disaggregated
                assert _placements(REMOTE) == remote + 1

                # A measurement of 1 ms per token on both workers (as earlier traffic would give;
                # the prefill worker's blends with its first request's, at least 0.3 ms a token
                # whatever the machine's load), and a backlog on the prefill worker: the idle
                # decode worker prefills the prompt itself (0.1 s against at least 15 s).
                placement = gateway.orchestrator.placement
                prefill_id = static_worker_id(Role.PREFILL, p.prefill.address)
                for worker in (prefill_id, static_worker_id(Role.DECODE, p.decode.address)):
                    gateway.orchestrator.pace.observe(worker, 1000, 1.0)
                placement.started(prefill_id, BACKLOG)
                local, local_prefills = _placements(LOCAL_PREDICTED), p.decode.server.metrics.local_prefills._value.get()
                assert await generate(_request(prompt)) == disaggregated
                assert _placements(LOCAL_PREDICTED) == local + 1
                assert p.decode.server.metrics.local_prefills._value.get() == local_prefills + 1

                # The request's own TTFT objective, twice the prefill worker's predicted TTFT, is
                # met there: it stays disaggregated; the gateway's default has none.
                remote = _placements(REMOTE)
                objective = 2 * placement.predict_ttft(prefill_id, len(prompt))
                assert await generate(_request(prompt, ttft_s=objective)) == disaggregated
                assert _placements(REMOTE) == remote + 1
                placement.ended(prefill_id, BACKLOG)
                assert placement.queued(prefill_id) == 0
            assert await p.decode.engine.num_free_blocks() == start

    asyncio.run(main())


def test_a_decoding_stream_counts_in_its_decode_workers_tpot_slack_until_it_ends(engines):
    """What a TPOT objective's placement reads: the gateway's streams on each decode worker,
    each from its first token to its end, and the lengths of the ones that ended."""
    prompt = [random.Random(4).randrange(1000, 40000) for _ in range(100)]

    async def main():
        async with gateway_over(engines) as (p, gateway, address):
            slack = gateway.orchestrator.placement.slack
            decode_id = static_worker_id(Role.DECODE, p.decode.address)
            short, long = _request(prompt), _request(prompt)
            long.sampling.max_tokens = 64
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                assert sum(len(m.token_ids) for m in await _collect(stub, short)) == 8
                assert slack.count(decode_id) == 0 and slack.expected_tokens == 7  # past the first
                sent = time.monotonic()
                call = stub.Generate(long)
                received = [await call.read(), await call.read()]  # the first token, then the decode stream's
                assert slack.count(decode_id) == 1
                # Expected to end like the one before, 7 tokens past its first, or after its next
                # one once past them (the gateway may have run ahead of this client), 63 at most:
                # at an objective of 1 s a token and no time a step, its slack is as many seconds
                # less the time it has run.
                assert 7 - (time.monotonic() - sent) <= slack.slack_s(decode_id, 1.0, 0.0) <= 63
                while (message := await call.read()) is not grpc.aio.EOF:
                    received.append(message)
            assert sum(len(m.token_ids) for m in received) == 64
            assert slack.count(decode_id) == 0 and slack.expected_tokens == pytest.approx(0.9 * 7 + 0.1 * 63)

    asyncio.run(main())


def test_a_request_whose_only_prefill_worker_is_draining_is_prefilled_on_the_decode_worker(engines):
    """The prefill worker's admission is closed, as a draining worker's is: its Prefill answers
    UNAVAILABLE and the retry prefills on the decode worker, well within the client's 20 s
    deadline, holding no block afterwards; the draining worker still shuts down at the end
    (its shutdown waited forever for a drain nobody had started, and the test hung there)."""
    prompt = [random.Random(5).randrange(1000, 40000) for _ in range(100)]

    async def main():
        async with gateway_over(engines) as (p, gateway, address):
            start = (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks())
            p.prefill.server.servicer.admission.open = False
            local_prefills = p.decode.server.metrics.local_prefills._value.get()
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                messages = [m async for m in stub.Generate(_request(prompt), timeout=20)]
            assert messages[-1].usage.completion_tokens == 8
            assert p.decode.server.metrics.local_prefills._value.get() == local_prefills + 1
            # The Aborts of the failed try go out in the background.
            deadline = time.monotonic() + 10
            while (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks()) != start:
                assert time.monotonic() < deadline, "blocks not freed"
                await asyncio.sleep(0.05)

    asyncio.run(main())


def test_a_prompt_lent_to_another_decode_worker_is_prefilled_there_and_decoded_on_its_own(engines, monkeypatch):
    """The gateway's side of a decode worker lent to a prefill. The lender routing offers (a
    decode worker that publishes ``serves_prefill``) is given the real prefill worker's address,
    where PrefillWorker is the same prefill service a lender serves (``cluster.prefill_service``;
    tests/workers/test_lent_prefill.py runs a real lender). With the
    prefill worker's queue 50 s long and the request's decode worker measured slow to prefill
    (10 s a token), placement lends the prompt: Prefill is called on the lender over the decode workers'
    channels, its KV reaches the request's decode worker, the tokens are the disaggregated ones,
    the lender's pace is measured, and every count and block is given back."""
    prompt = [random.Random(6).randrange(1000, 40000) for _ in range(100)]

    async def main():
        async with gateway_over(engines) as (p, gateway, address):
            view, placement = gateway.view, gateway.orchestrator.placement
            start = (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks())
            lender = WorkerInfo("decode-lender", Role.DECODE, p.prefill.address,
                                dataclasses.replace(view.pool, serves_prefill=True), WorkerLoad(free_blocks=96))
            choose = view.choose

            async def offering_the_lender(*args, **kwargs):
                return dataclasses.replace(await choose(*args, **kwargs), lender=lender)

            monkeypatch.setattr(view, "choose", offering_the_lender)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)

                async def generate(request) -> list[int]:
                    return [t for m in await asyncio.wait_for(_collect(stub, request), 120) for t in m.token_ids]

                disaggregated = await generate(_request(prompt))  # paces not measured yet: the prefill worker
                prefill_id = static_worker_id(Role.PREFILL, p.prefill.address)
                gateway.orchestrator.pace.observe(prefill_id, 1000, 1.0)  # 1 ms a token: the lender's prior
                placement.local_pace.observe(static_worker_id(Role.DECODE, p.decode.address), 1000, 10_000.0)
                placement.started(prefill_id, BACKLOG)
                lent, prefills = _placements(LENT), _prefills(LENT)
                local_prefills = p.decode.server.metrics.local_prefills._value.get()
                assert await generate(_request(prompt)) == disaggregated
                placement.ended(prefill_id, BACKLOG)
            assert _placements(LENT) == lent + 1
            assert _prefills(LENT) == prefills + 1  # whichever KV transport the blocks took
            assert p.decode.server.metrics.local_prefills._value.get() == local_prefills  # not prefilled there
            assert placement.pace.s_per_token(lender.worker_id) is not None  # measured by its Prefill call
            assert placement.queued(lender.worker_id) == 0
            assert all(w.load.num_seqs == 0 for role in Role for w in view.workers(role))
            deadline = time.monotonic() + 10
            while (await p.prefill.engine.num_free_blocks(), await p.decode.engine.num_free_blocks()) != start:
                assert time.monotonic() < deadline, "blocks not freed"
                await asyncio.sleep(0.05)

    asyncio.run(main())


async def _collect(stub, request) -> list[gateway_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(request)]
