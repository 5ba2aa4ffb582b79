"""Prefill and decode workers over real gRPC: disaggregated tokens equal one offline engine's,
every failure path (capacity, lease expiry, cancel, abort, shutdown) leaves no block behind."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest
import torch
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, EngineCore, SamplingParams
from engine.core import core_client, kv_cache_manager
from engine.core.core_client import EngineCoreClient, EngineError
from engine.block_hash import hash_blocks
from cluster.prefix_index import PrefixIndex
from cluster.registry import ClusterNamespace, Role, WorkerRegistry, redis_client
from kvtransfer import KVPool, encode_chunk
from protos.tandem.v1 import gateway_pb2, kvtransfer_pb2, worker_pb2

from tests.helpers.workers import pair

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
        assert not e.requests and not e.pinned


def prompt_ids(count: int, seed: int = 0) -> list[int]:
    """``count`` token ids, distinct per ``seed`` (no two prompts share a prefix by accident)."""
    return [(1000 * seed + 7 * i) % 40000 + 100 for i in range(count)]


def destination_of(p, admit: worker_pb2.AdmitResponse) -> worker_pb2.KVDestination:
    """What the gateway tells the prefill worker: the reservation Admit granted."""
    return worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id,
                                    layout=admit.layout, num_cached_blocks=admit.num_cached_blocks,
                                    kv_transports=admit.kv_transports)


async def start_decode(p, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams):
    """What the gateway does: Admit, Prefill into the reservation, then open the Decode stream;
    returns (the prefill response, the Decode call)."""
    admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=request_id, prompt_token_ids=prompt))
    pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, destination=destination_of(p, admit)))
    call = p.decode.stub.Decode(worker_pb2.DecodeRequest(
        request_id=request_id, reservation_id=admit.reservation_id, prompt_token_ids=prompt,
        first_token_ids=[t.token_id for t in pre.first_tokens], sampling=sampling))
    return pre, call


async def generate(p, request_id: str, prompt: list[int], sampling: gateway_pb2.SamplingParams):
    """:func:`start_decode`, read to its end; returns (first tokens, per-sample decoded token
    ids, per-sample finish reasons, prefill response)."""
    pre, call = await start_decode(p, request_id, prompt, sampling)
    first = [t.token_id for t in pre.first_tokens]
    n = len(first)
    tokens, reasons = [[] for _ in range(n)], [None] * n
    async for msg in call:
        assert reasons[msg.index] is None, "message after a sample's last one"
        assert len(msg.logprobs) == len(msg.token_ids)
        tokens[msg.index].extend(msg.token_ids)
        if msg.finish_reason:
            reasons[msg.index] = msg.finish_reason
    assert all(reasons), "every sample ends with a finish reason"
    return first, tokens, reasons, pre


def reference(offline: LLM, prompts, params: SamplingParams):
    return offline.generate(prompts, params, use_tqdm=False)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_greedy_through_the_pair_equals_offline(engines, offline, transport):
    tok = offline.get_tokenizer()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = reference(offline, prompts, SamplingParams(max_tokens=16, temperature=0))

    async def main():
        async with pair(engines, kv_transport=transport, kv_verify_checksums=True) as p:
            sampling = gateway_pb2.SamplingParams(max_tokens=16, temperature=0)
            return await asyncio.gather(*(generate(p, f"g{i}", ids, sampling) for i, ids in enumerate(prompts)))

    results = asyncio.run(main())
    for (first, tokens, reasons, pre), ref in zip(results, expected):
        assert pre.kv_transport == transport
        assert [first[0], *tokens[0]] == ref.outputs[0].token_ids
        want = gateway_pb2.FINISH_REASON_LENGTH if ref.outputs[0].finish_reason == "length" else gateway_pb2.FINISH_REASON_STOP
        assert reasons == [want]


def test_stream_interval_sends_tokens_in_groups_and_loses_none(engines, offline):
    """``stream_interval=4``: each Decode message but a sample's last carries at least 4 tokens,
    and the tokens are the offline engine's; with a local prefill the first token, which the
    time to first token waits for, comes alone in the first message."""
    tok = offline.get_tokenizer()
    prompt = tok.encode(PROMPTS[0], add_special_tokens=False)
    expected = reference(offline, [prompt], SamplingParams(max_tokens=14, temperature=0))[0].outputs[0].token_ids
    sampling = gateway_pb2.SamplingParams(max_tokens=14, temperature=0)

    async def main():
        async with pair(engines, stream_interval=4) as p:
            pre, call = await start_decode(p, "grouped", prompt, sampling)
            remote = [t.token_id for t in pre.first_tokens], [list(msg.token_ids) async for msg in call]
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="local", prompt_token_ids=prompt))
            local = [list(m.token_ids) async for m in p.decode.stub.Decode(worker_pb2.DecodeRequest(
                request_id="local", reservation_id=admit.reservation_id, prompt_token_ids=prompt, sampling=sampling,
                local_prefill=True))]
            return remote, local

    (first, messages), local = asyncio.run(main())
    assert [*first, *(t for m in messages for t in m)] == expected
    assert all(len(m) >= 4 for m in messages[:-1]) and len(messages) <= 4  # 13 decoded tokens, 4 at least a message
    assert [t for m in local for t in m] == expected
    assert len(local[0]) == 1 and all(len(m) >= 4 for m in local[1:-1])


def test_the_next_turn_is_neither_recomputed_nor_resent(engines, offline):
    """Multi-turn chat: the decode worker keeps the previous turn (prompt and answer) in its
    prefix cache; the next turn's Admit reports those blocks cached, and with a local prefill
    (conditional disaggregation) only the new question is computed, by the decode worker. The
    tokens equal the offline engine's over the same two turns, whose prefix cache holds turn 1
    as the decode worker's does (its answer's KV written by decode steps: a full prefill of
    turn 2 computes those positions another way, which in the GGUF's bfloat16 matmuls can flip
    a near-tie)."""
    tok = offline.get_tokenizer()
    turn1 = tok.encode(PROMPTS[0] + " in a small workshop where", add_special_tokens=False)
    sampling = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def main():
        async with pair(engines) as p:
            first, tokens, _, _ = await generate(p, "turn1", turn1, sampling)
            turn2 = turn1 + [first[0], *tokens[0]] + tok.encode(" Who worked there?", add_special_tokens=False)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="turn2", prompt_token_ids=turn2))
            local = [m async for m in p.decode.stub.Decode(worker_pb2.DecodeRequest(
                request_id="turn2", reservation_id=admit.reservation_id, prompt_token_ids=turn2, sampling=sampling,
                local_prefill=True))]
            return turn2, admit, local

    turn2, admit, local = asyncio.run(main())
    history = len(turn2) - len(tok.encode(" Who worked there?", add_special_tokens=False))
    assert admit.num_cached_blocks == (history - 1) // 16 and admit.num_cached_blocks * 16 >= 0.6 * len(turn2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    [answer] = reference(offline, [turn1], params)
    assert turn1 + answer.outputs[0].token_ids == turn2[:history]
    [ref] = reference(offline, [turn2], params)
    assert ref.num_cached_tokens == admit.num_cached_blocks * 16
    assert [t for m in local for t in m.token_ids] == ref.outputs[0].token_ids
    assert local[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH


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
    assert list(pre.finish_reasons) == [gateway_pb2.FINISH_REASON_UNSPECIFIED] * 2


def test_admit_beyond_capacity_is_resource_exhausted(engines):
    async def main():
        async with pair(engines) as p:
            stub, total = p.decode.stub, engines[1].num_blocks
            granted = 0
            for i in range(3):  # 3 x 20 of 64 blocks
                r = await stub.Admit(worker_pb2.AdmitRequest(request_id=f"cap{i}", prompt_token_ids=prompt_ids(20 * 16, i)))
                granted += r.num_blocks
            assert engines[1].num_free_blocks == total - granted
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Admit(worker_pb2.AdmitRequest(request_id="cap3",
                                                         prompt_token_ids=prompt_ids((total - granted + 1) * 16, 3)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert engines[1].num_free_blocks == total - granted
            with pytest.raises(grpc.aio.AioRpcError) as err:  # one request, one reservation
                await stub.Admit(worker_pb2.AdmitRequest(request_id="cap0", prompt_token_ids=prompt_ids(16, 0)))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            # GetStats reads the engine's last published snapshot, and the refused duplicate's
            # blocks come back on the engine thread: a few snapshots may still count them.
            for _ in range(250):
                stats = await stub.GetStats(worker_pb2.GetStatsRequest())
                if stats.num_free_blocks == total - granted:
                    break
                await asyncio.sleep(0.02)
            assert (stats.num_free_blocks, stats.num_waiting, stats.config.block_size) == (total - granted, 3, 16)
            assert (stats.config.role, stats.config.model_id, stats.config.kv_cache_dtype,
                    stats.config.max_num_batched_tokens) == \
                ("decode", engines[1].model_id, engines[1].kv_cache_dtype, engines[1].config.max_num_batched_tokens)
            for i in range(3):
                assert (await stub.Abort(worker_pb2.AbortRequest(request_id=f"cap{i}"))).found
            assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="cap0"))).found
            assert await p.decode.engine.num_free_blocks() == total

    asyncio.run(main())


def test_expired_lease_frees_the_reservation(engines):
    async def main():
        async with pair(engines, lease_s=0.2) as p:
            start = await p.decode.engine.num_free_blocks()
            r = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="lease", prompt_token_ids=prompt_ids(40)))
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
            _, call = await start_decode(p, "cancel", prompt, sampling)
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
            decode_start = await p.decode.engine.num_free_blocks()
            for how in ("abort", "cancel"):
                rid = f"prefill-{how}"
                admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt))
                call = p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=4),
                    destination=destination_of(p, admit)))
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
                assert time.monotonic() - t0 < 5.0  # at the end of the chunk computing, not at a lease's expiry
                # The prefill's transfer stream, open on the reservation since the prefill began,
                # ended with it: the decode worker has already freed the reservation.
                await until(lambda: len(p.decode.server.servicer.table) == 0)
                assert not (await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id=rid))).found
                # Its blocks go back once a read in flight has ended (after the table forgot it).
                await until(lambda: engines[1].num_free_blocks == decode_start)

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
                await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="b"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()

    asyncio.run(main())


def test_shutdown_drains_in_flight_and_refuses_new_work(engines, key_prefix, redis_url):
    async def main():
        ns = ClusterNamespace(key_prefix, 3.0)
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, ns)
        # A drain long enough for a slow, shared CI machine: it ends as soon as the stream does.
        async with pair(engines, redis_url=redis_url, redis_key_prefix=key_prefix,
                        heartbeat_interval_s=0.2, drain_timeout_s=120.0) as p:
            for _ in range(200):
                if len(await registry.live_workers(Role.DECODE)) == 1:
                    break
                await asyncio.sleep(0.05)
            [info] = await registry.live_workers(Role.DECODE)
            assert info.address == p.decode.address and info.load.total_blocks == engines[1].num_blocks

            prompt = list(range(200, 230))
            sampling = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="drain", prompt_token_ids=prompt))
            pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                request_id="drain", prompt_token_ids=prompt, sampling=sampling,
                destination=destination_of(p, admit)))
            # The prefill worker published the prompt's full block to the prefix index.
            index, hashes = PrefixIndex(client, ns), hash_blocks(prompt, 16, engines[0].hash_seed)
            for _ in range(200):
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
                await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="late", prompt_token_ids=prompt_ids(8)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            generated, last = list(first_msg.token_ids), first_msg
            while (msg := await call.read()) != grpc.aio.EOF:  # the in-flight request finishes
                generated.extend(msg.token_ids)
                last = msg
            assert len(generated) == 23 and last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
            await shutdown
            assert await registry.live_workers(Role.DECODE) == []  # deregistered
            assert len(await registry.live_workers(Role.PREFILL)) == 1
        await client.aclose()

    asyncio.run(main())


def test_shutdown_after_admission_was_closed_from_outside_drains_and_stops(engines):
    """A worker whose admission was closed before its shutdown began (as a draining worker's
    is) still shuts down: the stream in flight finishes, then the server stops (the shutdown
    took the closed admission for a shutdown already under way and waited for it forever)."""
    async def main():
        async with pair(engines) as p:
            prompt = list(range(400, 440))
            sampling = gateway_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            _, call = await start_decode(p, "closed", prompt, sampling)
            last = await call.read()
            generated = list(last.token_ids)
            p.decode.server.servicer.admission.open = False
            shutdown = asyncio.create_task(p.decode.server.shutdown())
            while (msg := await call.read()) != grpc.aio.EOF:  # the stream in flight finishes
                generated.extend(msg.token_ids)
                last = msg
            assert len(generated) == 23 and last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
            # The drain (drain_timeout_s 5 s) and each close step are bounded: 60 s is far beyond them.
            await asyncio.wait_for(shutdown, 60)

    asyncio.run(main())


def test_engine_failure_fails_the_request_not_the_engine_core(engines, monkeypatch):
    decode = engines[1]
    free = decode.num_free_blocks

    async def main():
        engine = await EngineCoreClient.embed(decode)
        try:
            blocks, _ = await engine.reserve_blocks(list(range(1, 21)))
            bad_token = decode.model_config.vocab_size + 5  # the engine refuses it and frees the blocks
            with pytest.raises(ValueError, match="first_token_ids"):
                async for _ in engine.add_prefilled("bad", list(range(1, 21)), [bad_token],
                                                    SamplingParams(max_tokens=4), blocks):
                    pass
            assert await engine.num_free_blocks() == free

            launch = decode.runner.launch
            calls = []

            def fail_once(step):
                calls.append(step)
                if len(calls) == 1:
                    raise RuntimeError("injected step failure")
                return launch(step)

            monkeypatch.setattr(decode.runner, "launch", fail_once)
            with pytest.raises(EngineError, match="engine step failed"):
                async for _ in engine.generate("doomed", [4, 5, 6], SamplingParams(max_tokens=3)):
                    pass
            outs = [o.outputs[0].token_ids[:]
                    async for o in engine.generate("good", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))]
            assert len(outs[-1]) == 3
            assert await engine.num_free_blocks() == free
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_engine_core_keeps_its_thread_count_when_the_other_threads_take_one(engines):
    """An embedded engine core's loop takes the intra-op thread count it is given, whatever the
    other threads of the process use (one OpenMP team per process: a worker's front end keeps
    one thread, its engine core, a process of its own, the rest). PyTorch fixes a thread's count
    at its first query, from the process-wide default: the loop takes its own count first."""
    before = torch.get_num_threads()

    async def main():
        engine = await EngineCoreClient.embed(engines[1], num_threads=3)
        torch.set_num_threads(1)
        try:
            assert engine.info.num_threads == 3
            assert torch.get_num_threads() == 1
            assert await asyncio.to_thread(torch.get_num_threads) == 1  # threads started later
        finally:
            await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        torch.set_num_threads(before)


def test_a_prefilled_request_streams_forward_when_the_event_loop_lags(engines, monkeypatch):
    """The engine core steps a just-joined request while the event loop is busy: the request's
    outputs still come in order, each with more tokens than the last, the first tokens once."""
    decode = engines[1]
    free = decode.num_free_blocks
    prompt, max_tokens = list(range(1, 21)), 24

    async def main():
        loop = asyncio.get_running_loop()
        add = decode.add_prefilled_request

        def add_then_stall_the_loop(*args, **kwargs):
            out = add(*args, **kwargs)
            loop.call_soon_threadsafe(time.sleep, 0.3)  # the engine steps meanwhile
            return out

        monkeypatch.setattr(decode, "add_prefilled_request", add_then_stall_the_loop)
        engine = await EngineCoreClient.embed(decode)
        try:
            blocks, _ = await engine.reserve_blocks(prompt)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            outputs = [list(out.outputs[0].token_ids)
                       async for out in engine.add_prefilled("lagging", prompt, [42], params, blocks)]
            lengths = [len(tokens) for tokens in outputs]
            assert lengths == sorted(set(lengths)) and lengths[-1] == max_tokens
            assert outputs[-1][0] == 42  # the prefill worker's first token, once: then max_tokens in all
            assert await engine.num_free_blocks() == free
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_prompts_are_hashed_on_the_event_loop_not_between_steps(engines, monkeypatch):
    """The engine core's client hashes a prompt's blocks on the caller's thread, the event loop,
    for ``reserve_blocks``, ``add_prefilled`` and ``generate``: the engine core's loop, whose time
    between two steps delays every running stream's next token, hashes none of them. A bad
    prompt is still refused naming it, and the reservation it came to replace is freed."""
    decode = engines[1]
    free = decode.num_free_blocks
    hashed_on = []

    def recording(original):
        def record(*args, **kwargs):
            hashed_on.append(threading.current_thread().name)
            return original(*args, **kwargs)
        return record

    monkeypatch.setattr(kv_cache_manager, "hash_blocks", recording(kv_cache_manager.hash_blocks))
    monkeypatch.setattr(core_client, "hash_blocks", recording(core_client.hash_blocks))

    async def main():
        engine = await EngineCoreClient.embed(decode)
        try:
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            prompt = prompt_ids(40, seed=9)
            blocks, _ = await engine.reserve_blocks(prompt)
            assert [o.finished async for o in engine.add_prefilled("hashed", prompt, [42], params, blocks)][-1]
            assert [o.finished async for o in engine.generate("local", prompt_ids(40, seed=10), params)][-1]
            reserved, _ = await engine.reserve_blocks(prompt_ids(40, seed=11))
            with pytest.raises(ValueError, match="prompt"):
                [o async for o in engine.generate("bad", [-1] * 20, params, release_blocks=reserved)]
            assert await engine.num_free_blocks() == free
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert len(hashed_on) >= 4 and "engine-core" not in hashed_on, hashed_on


def test_async_scheduling_loses_and_reorders_nothing(engines):
    """With async scheduling (forced on here on the CPU: each step is launched before the last
    one's tokens are processed, and reads the token in flight as its input) concurrent streams
    get the same tokens as without, each output longer than the last and the final one last; a
    request aborted mid-stream ends with finish reason ``abort`` after the tokens it had; every
    block comes back."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sync_engine = engines[1]
    async_engine = EngineCore(None, dataclasses.replace(sync_engine.config, async_scheduling=True))

    async def run(core: EngineCore, tag: str) -> dict[int, list]:
        free = core.num_free_blocks
        engine = await EngineCoreClient.embed(core)
        try:
            async def stream(request_id: str, prompt: list[int], abort_after: int | None = None) -> list:
                seen = []
                # (the aborted one could run far past its abort point: a busy event loop must not let it finish)
                limit = params if abort_after is None else SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
                async for out in engine.generate(request_id, prompt, limit):
                    seen.append(list(out.outputs[0].token_ids))
                    if abort_after is not None and len(seen[-1]) >= abort_after and not out.finished:
                        engine.abort(request_id)
                        abort_after = None
                    if out.finished:
                        seen.append(out.outputs[0].finish_reason)
                return seen

            results = await asyncio.gather(*(stream(f"{tag}-{i}", prompt_ids(20 + 3 * i, seed=i), 4 if i == 3 else None)
                                             for i in range(4)))
            assert await engine.num_free_blocks() == free
            return dict(zip(range(4), results))
        finally:
            await engine.shutdown()

    synchronous, overlapped = asyncio.run(run(sync_engine, "sync")), asyncio.run(run(async_engine, "async"))
    for i in range(3):
        *outputs, reason = overlapped[i]
        assert reason == "length" and outputs[-1] == synchronous[i][-2]  # every token, the same ones
        assert all(len(a) < len(b) and b[:len(a)] == a for a, b in zip(outputs, outputs[1:]))
    *outputs, reason = overlapped[3]
    assert reason == "abort" and 4 <= len(outputs[-1]) < 400
    assert all(len(a) <= len(b) and b[:len(a)] == a for a, b in zip(outputs, outputs[1:]))


def test_corrupted_kv_fails_that_request_only(engines):
    """A sender whose chunk fails its checksum gets DATA_LOSS and the reservation is freed; a
    request admitted beside it is untouched and completes."""
    async def main():
        async with pair(engines) as p:
            bad = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id="corrupt", prompt_token_ids=prompt_ids(40, 7)))
            chunk = encode_chunk(KVPool(p.decode.engine.kv_pools).gather([0, 1, 2]).clone(),
                                 reservation_id=bad.reservation_id, request_id="corrupt", first_block_index=0)
            chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
            call = p.decode.stub.TransferKV()
            await call.write(chunk)
            await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert len(p.decode.server.servicer.table) == 0  # the receiver released the reservation
            tok = engines[0].tokenizer
            first, tokens, reasons, _ = await generate(p, "fine", tok.encode(PROMPTS[0]),
                                                       gateway_pb2.SamplingParams(max_tokens=6, temperature=0))
            assert len([first[0], *tokens[0]]) == 6 and reasons == [gateway_pb2.FINISH_REASON_LENGTH]

    asyncio.run(main())


def test_prefill_slower_than_the_lease_keeps_its_reservation(engines):
    """Regression: a reservation's lease used to run out while a long prompt was still being
    prefilled (an 8191-token prompt failed with a false RESOURCE_EXHAUSTED). The transfer stream,
    opened before the prefill starts, keeps the reservation alive however long it takes."""
    prompt = [(11 * i) % 40000 + 100 for i in range(900)]  # 8 chunks of 128 tokens on the prefill engine

    async def main():
        async with pair(engines, lease_s=0.2) as p:
            sampling = gateway_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            t0 = time.monotonic()
            first, tokens, reasons, _ = await generate(p, "long", prompt, sampling)
            assert time.monotonic() - t0 > 0.4, "the prefill should outlast the lease twice over"
            assert len([first[0], *tokens[0]]) == 3 and reasons == [gateway_pb2.FINISH_REASON_LENGTH]

    asyncio.run(main())


def test_first_token_finish_reason_comes_from_the_prefill_worker(engines, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[0])
    [ref] = reference(offline, [ids], SamplingParams(max_tokens=1, temperature=0))
    greedy_first = ref.outputs[0].token_ids[0]

    async def main():
        async with pair(engines) as p:
            out = {}
            for name, sampling in (("length", gateway_pb2.SamplingParams(max_tokens=1, temperature=0)),
                                   ("stop", gateway_pb2.SamplingParams(max_tokens=8, temperature=0,
                                                                       stop_token_ids=[greedy_first]))):
                admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=name, prompt_token_ids=ids))
                pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=name, prompt_token_ids=ids, sampling=sampling, destination=destination_of(p, admit)))
                out[name] = list(pre.finish_reasons)
                await p.decode.stub.Abort(worker_pb2.AbortRequest(request_id=name))
            return out

    out = asyncio.run(main())
    assert out == {"length": [gateway_pb2.FINISH_REASON_LENGTH], "stop": [gateway_pb2.FINISH_REASON_STOP]}


def test_a_drain_out_of_time_fails_its_streams_unavailable_and_frees_their_blocks(engines):
    """What a drain could not finish ends UNAVAILABLE, which the gateway retries or resumes on
    another worker (a normal finish with reason ABORT reached clients as a cut-short answer)."""
    async def main():
        async with pair(engines, drain_timeout_s=0.0) as p:
            start = engines[1].num_free_blocks
            prompt = list(range(300, 340))
            sampling = gateway_pb2.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            _, call = await start_decode(p, "cut", prompt, sampling)
            await call.read()
            await p.decode.server.shutdown()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (msg := await call.read()) != grpc.aio.EOF:
                    assert msg.finish_reason != gateway_pb2.FINISH_REASON_ABORT
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "drain" in err.value.details()
            assert engines[1].num_free_blocks == start

    asyncio.run(main())
