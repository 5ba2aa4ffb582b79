"""Spot checks of received KV on real in-process workers (the real SmolLM2 model): a checked
request whose KV is what its prompt gives decodes exactly as an unchecked one; one whose received
blocks were replaced (a lying prefill worker's random KV, written into the reservation from the
test side after the transfer) gets DATA_LOSS before a token is decoded from them, and every block
returns to the pool; through a real gateway, a lying prefill worker is quarantined and the
client gets the right tokens."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
import torch

from cluster.registry import Role
from decode_worker.spot_check import TOLERANCE
from engine import LLM
from engine.sampling_params import SamplingParams
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings
from kvtransfer import KVPool
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2

from tests.helpers.engine import run_until_finished
from tests.helpers.prompts import GROUNDED_CHATS
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


def _prompt_blocks(engine, prompt: list[int], others: list[list[int]]) -> torch.Tensor:
    """The KV of ``prompt``'s full blocks (float32, ``[blocks, ...]``) as ``engine`` computes it
    with ``others`` prefilled beside it, in ``engine``'s chunks."""
    params = SamplingParams(max_tokens=1, temperature=0)
    for i, other in enumerate(others):
        engine.add_request(f"other-{i}", other, params)
    engine.add_request("checked", prompt, params, pin_prompt_blocks=True)
    out = run_until_finished(engine, "checked")
    while engine.has_unfinished_requests:
        engine.step()
    blocks = out.pinned_block_ids[:len(prompt) // engine.config.block_size]
    kv = engine.kv_cache.tensor[blocks].float()
    engine.release("checked")
    return kv


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_recomputed_bf16_and_fp8_blocks_differ_by_well_under_the_tolerance(kv_cache_dtype):
    """The real SmolLM2 in bf16 on the GPU: each block of a prompt computed in one chunk alone
    and in 48-token chunks beside three other prompts (a prefill and a decode worker's different
    batches) differs by under a third of its KV dtype's tolerance; the worst block's error is
    printed."""
    config = dict(device="cuda", dtype="bfloat16", quantization="none", block_size=16, gpu_memory_utilization=0.15,
                  kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    alone, chunked = LLM(**config).engine, LLM(**config, max_num_batched_tokens=48).engine
    prompts = [alone.tokenize(alone.tokenizer.apply_chat_template(chat)) for chat in GROUNDED_CHATS]
    tolerance = TOLERANCE[alone.kv_cache.tensor.dtype]
    worst = 0.0
    for i, prompt in enumerate(prompts):
        a = _prompt_blocks(alone, prompt, [])
        b = _prompt_blocks(chunked, prompt, [p for j, p in enumerate(prompts) if j != i])
        errors = torch.linalg.vector_norm((a - b).flatten(1), dim=1) / torch.linalg.vector_norm(a.flatten(1), dim=1)
        worst = max(worst, errors.max().item())
    print(f"KV {alone.kv_cache.tensor.dtype}: worst block relative error {worst:.3g}, tolerance {tolerance}")
    assert worst < tolerance / 3


def _lie(servicer, pool_tensors) -> None:
    """Make a prefill worker send random KV in place of its blocks (its own cache and first
    tokens stay right): the probe's compromised worker, injected from the test side at the
    boundary. Only the gRPC transport reads the blocks from the pool it is handed."""
    noise = KVPool([torch.randn(t.shape).to(t.dtype) for t in pool_tensors])
    real_open = servicer.sender.open

    @contextlib.asynccontextmanager
    async def lying_open(*args, **kwargs):
        async with real_open(*args, **kwargs) as transfer:
            send = transfer.send

            async def send_noise(pool, first_index, block_ids):
                await send(noise, first_index, block_ids)

            transfer.send = send_noise
            yield transfer

    servicer.sender.open = lying_open


def test_a_lying_prefill_worker_is_caught_quarantined_and_the_client_still_gets_the_right_tokens(engines):
    """At rate 1 every transferred prompt is checked: the liar's KV fails the check before any
    token reaches the client, the gateway quarantines it (in memory: static workers) and retries
    the request, which the decode worker now prefills itself; the next request goes to no
    prefill worker; every block returns."""
    async def main():
        async with pair(engines, prefill={"kv_transport": "grpc"}, decode={"kv_spot_check_rate": 1.0}) as p:
            start = (engines[0].num_free_blocks, engines[1].num_free_blocks)
            _lie(p.prefill.server.servicer, engines[0].kv_pools)
            settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, insecure=True,
                                       static_prefill=[p.prefill.address], static_decode=[p.decode.address],
                                       refresh_interval_s=0.1, local_prefill_max_tokens=0, quarantine_s=60)
            gateway = Gateway(settings, load_served_model(settings))
            port = await gateway.start()
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = gateway_pb2_grpc.GatewayStub(channel)
                    while not gateway.view.workers(Role.PREFILL):
                        await asyncio.sleep(0.05)
                    [liar] = gateway.view.workers(Role.PREFILL)
                    for seed in (21, 22):
                        prompt = prompt_ids(16 * 4 + 5, seed)
                        reference = None
                        async for out in p.decode.engine.generate(f"reference-{seed}", prompt, SamplingParams(
                                max_tokens=8, temperature=0, ignore_eos=True), cache_salt=f"reference-{seed}"):
                            reference = out.outputs[0].token_ids
                        prefilled = engines[0].kv_manager.prefix_queries
                        request = gateway_pb2.GenerateRequest(
                            token_ids=gateway_pb2.TokenIds(ids=prompt),
                            sampling=gateway_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                        tokens = [t async for m in stub.Generate(request, timeout=120) for t in m.token_ids]
                        assert tokens == reference, seed
                        assert gateway.view.quarantine.quarantined(liar.worker_id)
                        if seed == 22:  # quarantined: the prompt went to no prefill worker
                            assert engines[0].kv_manager.prefix_queries == prefilled
                    checks = p.decode.server.servicer.metrics.kv_spot_checks
                    assert checks.labels("failed")._value.get() >= 1
                    assert "spot check" in gateway.view.quarantine.active()[liar.worker_id]
            finally:
                await gateway.stop(grace_s=1)
            deadline = asyncio.get_running_loop().time() + 10
            while (engines[0].num_free_blocks, engines[1].num_free_blocks) != start or engines[1].requests:
                assert asyncio.get_running_loop().time() < deadline, "blocks did not return"
                await asyncio.sleep(0.05)

    asyncio.run(main())
