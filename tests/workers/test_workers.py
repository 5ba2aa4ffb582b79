"""Prefill and decode workers over real gRPC: disaggregated tokens equal one offline engine's,
every failure path (capacity, lease expiry, cancel, abort, shutdown) leaves no block behind."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineError
from engine.block_hash import hash_blocks, hash_seed
from gateway.prefix_index import PrefixIndex
from gateway.registry import ClusterNamespace, Role, WorkerRegistry, redis_client
from protos.tandem.v1 import gateway_pb2, kvtransfer_pb2, worker_pb2

from .conftest import REDIS_URL, pair

pytestmark = pytest.mark.slow

PROMPTS = ["The history of the printing press began", "List three prime numbers and explain why"]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(None, block_size=16, num_blocks=64)


def free_blocks(engines) -> tuple[int, int]:
    return engines[0].num_free_blocks, engines[1].num_free_blocks


@pytest.fixture(autouse=True)
def no_leaks(engines):
    """Both pools are back to their start after every test."""
    start = free_blocks(engines)
    yield
    assert free_blocks(engines) == start
    for e in engines:
        e.block_pool.check_invariants()
        assert not e.requests and not e.held


async def generate(p, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams):
    """What the gateway does: Admit, Prefill into the reservation, Decode; returns
    (first tokens, per-sample decoded token ids, per-sample finish reasons, prefill response)."""
    admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=request_id, num_prompt_tokens=len(prompt)))
    destination = worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id,
                                           layout=admit.layout)
    pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, destination=destination))
    first = [t.token_id for t in pre.first_tokens]
    n = len(first)
    tokens, reasons = [[] for _ in range(n)], [None] * n
    async for msg in p.decode.stub.Decode(worker_pb2.DecodeRequest(
            request_id=request_id, reservation_id=admit.reservation_id, prompt_token_ids=prompt,
            first_token_ids=first, sampling=sampling, seed_state=pre.seed_state)):
        assert reasons[msg.index] is None, "message after a sample's last one"
        assert len(msg.logprobs) == len(msg.token_ids)
        tokens[msg.index].extend(msg.token_ids)
        if msg.finish_reason:
            reasons[msg.index] = msg.finish_reason
    assert all(reasons), "every sample ends with a finish reason"
    return first, tokens, reasons, pre


def reference(offline: LLM, prompts, params: SamplingParams):
    return offline.generate(prompts, params, use_tqdm=False)


async def until(predicate, timeout_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_greedy_through_the_pair_equals_offline(engines, offline):
    tok = offline.get_tokenizer()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = reference(offline, prompts, SamplingParams(max_tokens=16, temperature=0))

    async def main():
        async with pair(engines) as p:
            sampling = gateway_pb2.SamplingParams(max_tokens=16, temperature=0)
            return await asyncio.gather(*(generate(p, f"g{i}", ids, sampling) for i, ids in enumerate(prompts)))

    results = asyncio.run(main())
    for (first, tokens, reasons, _), ref in zip(results, expected):
        assert [first[0], *tokens[0]] == ref.outputs[0].token_ids
        want = gateway_pb2.FINISH_REASON_LENGTH if ref.outputs[0].finish_reason == "length" else gateway_pb2.FINISH_REASON_STOP
        assert reasons == [want]


def test_seeded_n2_through_the_pair_equals_offline(engines, offline):
    tok = offline.get_tokenizer()
    ids = tok.encode(PROMPTS[1], add_special_tokens=False)
    [ref] = reference(offline, [ids], SamplingParams(max_tokens=12, temperature=0.8, seed=11, n=2, ignore_eos=True))

    async def main():
        async with pair(engines) as p:
            sampling = gateway_pb2.SamplingParams(max_tokens=12, temperature=0.8, seed=11, n=2, ignore_eos=True,
                                                  logprobs=2)
            return await generate(p, "seeded", ids, sampling)

    first, tokens, reasons, pre = asyncio.run(main())
    assert [[f, *t] for f, t in zip(first, tokens)] == [c.token_ids for c in ref.outputs]
    assert reasons == [gateway_pb2.FINISH_REASON_LENGTH] * 2
    assert all(len(t.top_logprobs) == 2 for t in pre.first_tokens)
    assert pre.seed_state.seed == 11


def test_admit_beyond_capacity_is_resource_exhausted(engines):
    async def main():
        async with pair(engines) as p:
            stub, total = p.decode.stub, engines[1].num_blocks
            granted = 0
            for i in range(3):  # 3 x 20 of 64 blocks
                r = await stub.Admit(worker_pb2.AdmitRequest(request_id=f"cap{i}", num_prompt_tokens=20 * 16))
                granted += r.num_blocks
            assert engines[1].num_free_blocks == total - granted
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Admit(worker_pb2.AdmitRequest(request_id="cap3", num_prompt_tokens=(total - granted + 1) * 16))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert engines[1].num_free_blocks == total - granted
            with pytest.raises(grpc.aio.AioRpcError) as err:  # one request, one reservation
                await stub.Admit(worker_pb2.AdmitRequest(request_id="cap0", num_prompt_tokens=16))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            stats = await stub.GetStats(worker_pb2.GetStatsRequest())
            assert (stats.num_free_blocks, stats.num_waiting, stats.block_size) == (total - granted, 3, 16)
            for i in range(3):
                assert (await stub.Abort(worker_pb2.AbortRequest(request_id=f"cap{i}"))).found
            assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="cap0"))).found
            assert await p.decode.engine.num_free_blocks() == total

    asyncio.run(main())


def test_expired_lease_frees_the_reservation(engines):
    async def main():
        async with pair(engines) as p:
            start = await p.decode.engine.num_free_blocks()
            r = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="lease", num_prompt_tokens=40,
                                                                  lease_ms=200))
            assert r.lease_ms == 200 and r.num_blocks == 3
            assert await p.decode.engine.num_free_blocks() == start - 3
            await asyncio.sleep(0.6)
            assert await p.decode.engine.num_free_blocks() == start
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in p.decode.stub.Decode(worker_pb2.DecodeRequest(
                        request_id="lease", reservation_id=r.reservation_id, prompt_token_ids=[1] * 40,
                        first_token_ids=[2], sampling=gateway_pb2.SamplingParams(max_tokens=4))):
                    pass
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(main())


def test_cancelled_decode_stream_frees_blocks_within_a_second(engines):
    async def main():
        async with pair(engines) as p:
            start = await p.decode.engine.num_free_blocks()
            prompt = list(range(100, 140))
            sampling = gateway_pb2.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="cancel", num_prompt_tokens=40))
            pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                request_id="cancel", prompt_token_ids=prompt, sampling=sampling,
                destination=worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id)))
            call = p.decode.stub.Decode(worker_pb2.DecodeRequest(
                request_id="cancel", reservation_id=admit.reservation_id, prompt_token_ids=prompt,
                first_token_ids=[pre.first_tokens[0].token_id], sampling=sampling))
            received = 0
            async for msg in call:
                received += len(msg.token_ids)
                if received >= 3:
                    break
            call.cancel()
            t0 = time.monotonic()
            await until(lambda: engines[1].num_free_blocks == start and not engines[1].requests)
            assert time.monotonic() - t0 < 1.0

    asyncio.run(main())


def test_abort_and_cancel_during_prefill_free_blocks(engines):
    prompt = [(7 * i) % 40000 + 100 for i in range(600)]  # 5 chunks of 128 tokens on the prefill engine

    async def main():
        async with pair(engines) as p:
            start = await p.prefill.engine.num_free_blocks()
            for how in ("abort", "cancel"):
                rid = f"prefill-{how}"
                admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=rid, num_prompt_tokens=600))
                call = p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=4),
                    destination=worker_pb2.KVDestination(address=p.decode.address,
                                                         reservation_id=admit.reservation_id)))
                await until(lambda: rid in engines[0].requests, 5.0)  # computing
                if how == "abort":
                    assert (await p.prefill.stub.Abort(worker_pb2.AbortRequest(request_id=rid, reason="test"))).found
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() == grpc.StatusCode.ABORTED
                else:
                    call.cancel()
                t0 = time.monotonic()
                await until(lambda: engines[0].num_free_blocks == start and rid not in engines[0].requests)
                assert time.monotonic() - t0 < 1.0
                # The gateway tells the decode side too.
                assert (await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id=rid))).found

    asyncio.run(main())


def test_bad_requests_are_refused_naming_the_field(engines):
    async def main():
        async with pair(engines) as p:
            dest = worker_pb2.KVDestination(address=p.decode.address, reservation_id="x")
            cases = [
                (worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=[], destination=dest),
                 grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
                (worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=[1, 2], destination=dest,
                                           sampling=gateway_pb2.SamplingParams(top_p=1.5)),
                 grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
                (worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=[1] * 2000, destination=dest),
                 grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
                (worker_pb2.PrefillRequest(
                    request_id="b", prompt_token_ids=[1, 2],
                    destination=worker_pb2.KVDestination(
                        address=p.decode.address, reservation_id="x",
                        layout=kvtransfer_pb2.KVBlockLayout(dtype="float32", block_shape=[30, 2, 8, 3, 64]))),
                 grpc.StatusCode.FAILED_PRECONDITION, "layout"),
                (worker_pb2.PrefillRequest(request_id="b", prompt_token_ids=[1, 2], destination=dest),
                 grpc.StatusCode.NOT_FOUND, "reservation"),  # the decode worker's refusal, passed on
            ]
            for request, code, word in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await p.prefill.stub.Prefill(request)
                assert err.value.code() == code and word in err.value.details(), err.value
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="b", num_prompt_tokens=0))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_prompt_tokens" in err.value.details()

    asyncio.run(main())


def test_shutdown_drains_in_flight_and_refuses_new_work(engines, key_prefix):
    async def main():
        ns = ClusterNamespace(key_prefix, engines[0].model_id, 16)
        client = redis_client(REDIS_URL)
        registry = WorkerRegistry(client, ns)
        async with pair(engines, redis_url=REDIS_URL, redis_key_prefix=key_prefix,
                        heartbeat_interval_s=0.2) as p:
            for _ in range(50):
                if len(await registry.live_workers(Role.DECODE)) == 1:
                    break
                await asyncio.sleep(0.05)
            [info] = await registry.live_workers(Role.DECODE)
            assert info.address == p.decode.address and info.load.total_blocks == engines[1].num_blocks

            prompt = list(range(200, 230))
            sampling = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="drain", num_prompt_tokens=30))
            pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                request_id="drain", prompt_token_ids=prompt, sampling=sampling,
                destination=worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id)))
            # The prefill worker published the prompt's full block to the prefix index.
            index, hashes = PrefixIndex(client, ns), hash_blocks(prompt, 16, hash_seed(engines[0].model_id, 16, "float32"))
            for _ in range(50):
                if (await index.cached_runs([p.prefill.server.worker_id], hashes)) == {p.prefill.server.worker_id: 1}:
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail("the prompt's block never reached the prefix index")
            call = p.decode.stub.Decode(worker_pb2.DecodeRequest(
                request_id="drain", reservation_id=admit.reservation_id, prompt_token_ids=prompt,
                first_token_ids=[pre.first_tokens[0].token_id], sampling=sampling))
            first_msg = await call.read()
            shutdown = asyncio.create_task(p.decode.server.shutdown())
            health = health_pb2_grpc.HealthStub(p.decode.channel)
            await until(lambda: not p.decode.server.servicer.admission.open)
            reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.DecodeWorker"))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="late", num_prompt_tokens=8))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            tokens, last = list(first_msg.token_ids), first_msg
            while (msg := await call.read()) != grpc.aio.EOF:  # the in-flight request finishes
                tokens.extend(msg.token_ids)
                last = msg
            assert len(tokens) == 23 and last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
            await shutdown
            assert await registry.live_workers(Role.DECODE) == []  # deregistered
            assert len(await registry.live_workers(Role.PREFILL)) == 1
        await client.aclose()

    asyncio.run(main())


def test_engine_failure_fails_the_request_not_the_thread(engines, monkeypatch):
    decode = engines[1]
    free = decode.num_free_blocks

    async def main():
        engine = AsyncEngine(decode)
        engine.start()
        try:
            blocks = await engine.reserve_blocks(20)
            bad_token = decode.model_config.vocab_size + 5  # the engine refuses it and frees the blocks
            with pytest.raises(ValueError, match="first_token_ids"):
                async for _ in engine.add_prefilled("bad", list(range(1, 21)), [bad_token],
                                                    SamplingParams(max_tokens=4), blocks):
                    pass
            assert await engine.num_free_blocks() == free

            execute = decode.runner.execute
            calls = []

            def fail_once(step):
                calls.append(step)
                if len(calls) == 1:
                    raise RuntimeError("injected step failure")
                return execute(step)

            monkeypatch.setattr(decode.runner, "execute", fail_once)
            with pytest.raises(EngineError, match="engine step failed"):
                async for _ in engine.generate("doomed", [4, 5, 6], SamplingParams(max_tokens=3)):
                    pass
            outs = [o async for o in engine.generate("good", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            assert await engine.num_free_blocks() == free
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_corrupted_kv_chunk_is_data_loss_and_frees_both_sides(engines, monkeypatch):
    monkeypatch.setenv("TANDEM_TEST_CORRUPT_KV", "corrupt-me")

    async def main():
        async with pair(engines) as p:
            prompt = list(range(300, 340))
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="corrupt-me-1", num_prompt_tokens=40))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id="corrupt-me-1", prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=2),
                    destination=worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id)))
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert len(p.decode.server.servicer.table) == 0  # the receiver released the reservation

    asyncio.run(main())
