"""A decode worker that also serves prefill (``serves_prefill``), over real gRPC: it prefills a
prompt for another decode worker, whose greedy tokens then equal the offline engine's over
either KV transport; its pinned blocks are freed after the transfer, on Abort, on a cancelled
call and on a failed transfer, and the other worker's reservation too; it says so in its
published config, and a plain decode worker serves no Prefill. Under mTLS the gateway's
certificate may call the lender's Prefill and no worker's may, and the lender's KV push (with
its decode certificate) is taken by the other decode worker."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cluster.tls import CLUSTER_NAME, TlsFiles, init_certs
from engine import LLM, SamplingParams
from protos.tandem.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

from tests.helpers.workers import lending_pair

pytestmark = pytest.mark.slow

GREEDY = gateway_pb2.SamplingParams(max_tokens=12, temperature=0)
# What a prefill whose transfer the decode worker refused ends with: a status the gateway retries
# elsewhere (gateway/worker_calls.py).
RETRIED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(None, block_size=16, num_blocks=64)


def prompt_ids(count: int, seed: int) -> list[int]:
    return [(1000 * seed + 7 * i) % 40000 + 100 for i in range(count)]


def destination(address: str, admit: worker_pb2.AdmitResponse, reservation_id: str = "") -> worker_pb2.KVDestination:
    return worker_pb2.KVDestination(address=address, reservation_id=reservation_id or admit.reservation_id,
                                    layout=admit.layout, num_cached_blocks=admit.num_cached_blocks,
                                    kv_transports=admit.kv_transports)


async def lent_generate(decode, lender, address: str, request_id: str, prompt: list[int],
                        sampling: gateway_pb2.SamplingParams) -> tuple[worker_pb2.PrefillResponse, list[int]]:
    """What the gateway does for a lent prefill: Admit on the decode worker, Prefill on the lender
    into that reservation, Decode on the decode worker; returns the prefill response and sample 0's
    tokens (the first one the lender's)."""
    admit = await decode.Admit(worker_pb2.AdmitRequest(request_id=request_id, prompt_token_ids=prompt))
    pre = await lender.Prefill(worker_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                                         sampling=sampling, destination=destination(address, admit)))
    tokens = [pre.first_tokens[0].token_id]
    async for message in decode.Decode(worker_pb2.DecodeRequest(
            request_id=request_id, reservation_id=admit.reservation_id, prompt_token_ids=prompt,
            first_token_ids=[t.token_id for t in pre.first_tokens], sampling=sampling)):
        tokens.extend(message.token_ids)
    return pre, tokens


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def settled(engines, start: tuple[int, int]) -> bool:
    """Both pools back to ``start``, no request left in either engine and nothing pinned."""
    return (engines[0].num_free_blocks, engines[1].num_free_blocks) == start and not any(
        e.requests or e.pinned for e in engines)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_a_prompt_lent_to_a_decode_worker_reaches_the_other_one_and_decodes_as_offline(engines, offline, transport):
    tok = offline.get_tokenizer()
    prompts = [tok.encode(text, add_special_tokens=False)
               for text in ("The history of the printing press began", "List three prime numbers and explain why")]
    expected = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    start = (engines[0].num_free_blocks, engines[1].num_free_blocks)

    async def main():
        async with lending_pair(engines, kv_transport=transport, kv_verify_checksums=True) as p:
            results = await asyncio.gather(*(lent_generate(p.decode.stub, p.prefill.stub, p.decode.address, f"l{i}",
                                                           ids, GREEDY) for i, ids in enumerate(prompts)))
            for (pre, tokens), ref in zip(results, expected):
                assert pre.kv_transport == transport
                assert tokens == ref.outputs[0].token_ids
            assert p.decode.server.metrics.local_prefills._value.get() == 0  # the KV came from the lender
            lender_stats = await worker_pb2_grpc.DecodeWorkerStub(p.prefill.channel).GetStats(
                worker_pb2.GetStatsRequest())
            decode_stats = await p.decode.stub.GetStats(worker_pb2.GetStatsRequest())
            assert (lender_stats.config.serves_prefill, decode_stats.config.serves_prefill) == (True, False)
            assert (lender_stats.config.role, p.prefill.server.servicer.lent.config.serves_prefill) == ("decode", True)
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a plain decode worker serves no Prefill
                await worker_pb2_grpc.PrefillWorkerStub(p.decode.channel).Prefill(worker_pb2.PrefillRequest(
                    request_id="plain", prompt_token_ids=prompts[0]))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await until(lambda: settled(engines, start))

    asyncio.run(main())


def test_a_lent_prefill_frees_both_workers_blocks_on_abort_cancel_and_a_failed_transfer(engines):
    prompt = prompt_ids(600, 1)  # 5 chunks of 128 tokens on the lender's engine
    start = (engines[0].num_free_blocks, engines[1].num_free_blocks)

    async def main():
        async with lending_pair(engines) as p:
            for how in ("abort", "cancel", "failed transfer"):
                rid = f"lent-{how.replace(' ', '-')}"
                admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=rid, prompt_token_ids=prompt))
                call = p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=4),
                    destination=destination(p.decode.address, admit)))
                await until(lambda: rid in engines[0].requests)  # computing
                if how == "cancel":
                    call.cancel()
                else:
                    # Abort on the lender (the gateway's), or on the decode worker, whose
                    # reservation then refuses the rest of the lender's transfer.
                    stub = p.prefill.stub if how == "abort" else p.decode.stub
                    assert (await stub.Abort(worker_pb2.AbortRequest(request_id=rid, reason="test"))).found
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call
                    assert err.value.code() in ((grpc.StatusCode.ABORTED,) if how == "abort" else RETRIED), \
                        err.value.code()
                # The transfer stream, open on the reservation since the prefill began, ended with
                # it: the decode worker has freed the reservation already.
                await until(lambda: len(p.decode.server.servicer.table) == 0)
                await until(lambda: settled(engines, start))

    asyncio.run(main())


def test_under_mtls_only_the_gateway_calls_a_lenders_prefill_and_its_kv_push_is_taken(engines, tmp_path):
    init_certs(str(tmp_path))
    prompt = prompt_ids(40, 2)
    start = (engines[0].num_free_blocks, engines[1].num_free_blocks)
    options = [("grpc.ssl_target_name_override", CLUSTER_NAME)]

    def credentials(role: str) -> grpc.ChannelCredentials:
        return TlsFiles.load(str(tmp_path), role, "tls_dir").channel_credentials()

    async def main():
        async with lending_pair(engines, tls_dir=str(tmp_path)) as p:
            gateway = credentials("gateway")
            async with grpc.aio.secure_channel(p.decode.address, gateway, options=options) as dch, \
                    grpc.aio.secure_channel(p.prefill.address, gateway, options=options) as lch:
                decode, lender = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(lch)
                pre, tokens = await lent_generate(decode, lender, p.decode.address, "tls", prompt, GREEDY)
                assert len(tokens) == GREEDY.max_tokens and pre.kv_transport  # pushed with the decode certificate
                stream = decode.TransferKV()  # the gateway's certificate pushes no KV
                await stream.done_writing()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "prefill or decode" in err.value.details()
            for role in ("decode", "prefill"):  # no worker's certificate calls a lender's Prefill
                async with grpc.aio.secure_channel(p.prefill.address, credentials(role), options=options) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                            worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=prompt))
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "gateway" in err.value.details()
            await until(lambda: settled(engines, start))

    asyncio.run(main())
