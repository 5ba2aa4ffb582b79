"""Spot checks of received KV on real in-process workers (the real SmolLM2 model): a checked
request whose KV is what its prompt gives decodes exactly as an unchecked one; one whose received
blocks were replaced (a lying prefill worker's random KV, written into the reservation from the
test side after the transfer) gets DATA_LOSS before a token is decoded from them, and every block
returns to the pool."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from decode_worker.spot_check import TOLERANCE
from kvtransfer import KVPool
from protos.tandem.v1 import gateway_pb2, worker_pb2

from tests.helpers.workers import pair

pytestmark = pytest.mark.slow

SAMPLING = gateway_pb2.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompt_ids(count: int, seed: int) -> list[int]:
    return [(1000 * seed + 7 * i) % 40000 + 100 for i in range(count)]


async def _run(p, request_id: str, prompt: list[int], check: bool, corrupt=None) -> list[int]:
    """Admit (asking for a check or not), Prefill into the reservation, ``corrupt(block_ids)``
    the received blocks, then Decode; the tokens (the prefill's first one included)."""
    admit = await p.decode.stub.Admit(worker_pb2.AdmitRequest(request_id=request_id, prompt_token_ids=prompt,
                                                              kv_spot_check=check))
    assert admit.kv_spot_check == check  # the fixture's rate is 0: checked exactly when asked
    pre = await p.prefill.stub.Prefill(worker_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=SAMPLING,
        destination=worker_pb2.KVDestination(address=p.decode.address, reservation_id=admit.reservation_id,
                                             layout=admit.layout, num_cached_blocks=admit.num_cached_blocks,
                                             kv_transports=admit.kv_transports)))
    if corrupt is not None:
        reservation = p.decode.server.servicer.table.get(admit.reservation_id)
        corrupt(reservation.block_ids[reservation.num_cached:len(prompt) // 16])
    first = [t.token_id for t in pre.first_tokens]
    call = p.decode.stub.Decode(worker_pb2.DecodeRequest(
        request_id=request_id, reservation_id=admit.reservation_id, prompt_token_ids=prompt,
        first_token_ids=first, sampling=SAMPLING, kv_spot_check=admit.kv_spot_check))
    return first + [t async for m in call for t in m.token_ids]


def test_a_checked_request_decodes_as_an_unchecked_one_and_random_kv_is_refused(engines):
    pool = KVPool(engines[1].kv_pools)

    def randomize(block_ids):
        blocks = pool.gather(block_ids)
        pool.scatter(block_ids, torch.randn(blocks.shape).to(blocks.dtype) * blocks.float().std())

    async def main():
        async with pair(engines, kv_spot_check_rate=0.0) as p:
            start = engines[1].num_free_blocks
            checks = p.decode.server.servicer.metrics.kv_spot_checks
            prompt = prompt_ids(16 * 5 + 3, seed=11)
            checked = await _run(p, "checked", prompt, check=True)  # first: no block of it cached here yet
            plain = await _run(p, "plain", prompt, check=False)
            assert checked == plain and len(plain) == 6
            assert checks.labels("passed")._value.get() == 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _run(p, "lied-to", prompt_ids(16 * 4 + 9, seed=12), check=True, corrupt=randomize)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert "kv spot check: prompt block" in err.value.details()
            assert checks.labels("failed")._value.get() == 1
            # An unchecked request takes whatever arrived: what the rate and quarantine are for.
            assert len(await _run(p, "unchecked", prompt_ids(16 * 4 + 9, seed=13), check=False,
                                  corrupt=randomize)) == 6
            deadline = asyncio.get_running_loop().time() + 10
            while engines[1].num_free_blocks != start or engines[1].requests:
                assert asyncio.get_running_loop().time() < deadline, "blocks did not return"
                await asyncio.sleep(0.05)
            engines[1].block_pool.check_invariants()
            assert not engines[1].pinned

    asyncio.run(main())


def test_every_kv_dtype_has_a_tolerance_above_its_rounding_and_below_what_garbage_gives():
    for dtype, tolerance in TOLERANCE.items():
        assert 0 < tolerance < 0.5, dtype
        a = torch.randn(4096).to(dtype).float()
        b = torch.randn(4096).to(dtype).float()
        assert torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b) > 2 * tolerance  # random KV
        # the same values with noise of half a rounding step of the dtype, rounded again
        eps = torch.finfo(dtype).eps
        rounded = (a * (1 + eps / 2 * torch.randn(4096))).to(dtype).float()
        assert torch.linalg.vector_norm(rounded - a) / torch.linalg.vector_norm(a) < tolerance, dtype
