"""End-to-end KV digests over a real grpc.aio DecodeWorker on loopback and real NIXL agents (UCX
over host memory): faults injected at the transport boundary (a chunk changed on the wire with
its CRC-32 made to match, a NIXL read that lands other bytes) are refused with ABORTED after
the blocks landed and before they count as arrived; the reservation's blocks go back to the
pool zeroed (refused bytes never linger in a slot handed out again), the refusal is counted and
the sender named in the log."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import torch

from engine.loading.model_config import ModelConfig
from kvtransfer import GRPC_MESSAGE_OPTIONS, KVDestination, KVPool, KVTransferClient
from kvtransfer.digest import block_digests, pool_digests
from kvtransfer.reservations import Reservation
from kvtransfer.nixl import NixlAgent
from kvtransfer.wire import crc32
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2
from tests.helpers.kv_peers import (
    CONFIG, DST_IDS, NUM_BLOCKS, SRC_IDS, DecodePeer, TamperingStub, agent, blocks, decode_worker, make_pool,
    send_blocks, wait_for,
)

FAULTS = ["flipped bit", "truncated", "wrong slot"]


def tamper_chunks(src: KVPool, fault: str):
    """A gRPC chunk fault (one block per chunk): the first chunk's bytes changed and its CRC-32
    recomputed, as if the bytes changed before the checksum (a host copy, a sender's bug)."""
    async def tamper(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
        if i == 0:
            data = bytearray(chunk.data)
            if fault == "flipped bit":
                data[len(data) // 3] ^= 0x10
            elif fault == "truncated":  # the tail never arrived: zeros where it should be
                data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
            else:  # the bytes of another block than the one announced
                data = bytearray(src.gather([SRC_IDS[-1]]).contiguous().view(torch.uint8).numpy().tobytes())
            chunk.data, chunk.crc32 = bytes(data), crc32(bytes(data))
        return chunk

    return tamper


def faulty_reads(receiver_agent: NixlAgent, dst: KVPool, fault: str) -> None:
    """A NIXL read fault: the read lands other bytes in the last receiving rank's part of the first
    block than the sender's (a bit flipped, the tail of its span left unwritten), or reads each
    block from the sender's next slot."""
    read = receiver_agent.read

    async def faulty(peer, src_blocks, dst_blocks):
        if fault == "wrong slot":
            src_blocks = [(b + 1) % NUM_BLOCKS for b in src_blocks]
        await read(peer, src_blocks, dst_blocks)
        raw = dst.ranks[-1].tensor[dst_blocks[0]].view(-1).view(torch.uint8)
        if fault == "flipped bit":
            raw[raw.numel() // 3] ^= 0x10
        elif fault == "truncated":
            raw[raw.numel() // 2:] = 0

    receiver_agent.read = faulty


async def transfer(peer: DecodePeer, src: KVPool, transport: str, sender_agent: NixlAgent | None,
                   stub=None) -> Reservation:
    """Send SRC_IDS into a fresh reservation of request ``req-1`` (one block per gRPC chunk);
    returns the reservation."""
    reservation = peer.table.reserve("req-1", DST_IDS)
    if transport == "grpc":
        await send_blocks(stub or peer.stub, src, SRC_IDS, reservation_id=reservation.reservation_id,
                          request_id="req-1", max_chunk_bytes=1)
        return reservation
    channel = grpc.aio.insecure_channel(peer.address, options=GRPC_MESSAGE_OPTIONS)
    sender = KVTransferClient(lambda address: channel, transports=["nixl"], nixl=sender_agent)
    try:
        destination = KVDestination(peer.address, reservation.reservation_id, kv_transports=("nixl",))
        async with sender.open(destination, "req-1") as stream:
            await stream.send(src, 0, SRC_IDS[:2])
            await stream.send(src, 2, SRC_IDS[2:])
            await stream.finish()
    finally:
        await channel.close()
    return reservation


def run_refused(src: KVPool, dst: KVPool, transport: str, *, fault: str | None = None,
                expected: grpc.StatusCode = grpc.StatusCode.ABORTED) -> StatusError:
    """Run one transfer that must be refused: returns the sender's error, after checking that
    the reservation was released (every block back) and what was counted."""
    sender_agent = agent(src) if transport == "nixl" else None
    receiver_agent = agent(dst) if transport == "nixl" else None
    if receiver_agent is not None and fault is not None:
        faulty_reads(receiver_agent, dst, fault)
    stub = None

    async def scenario() -> StatusError:
        nonlocal stub
        async with decode_worker(dst, nixl=receiver_agent) as peer:
            if transport == "grpc" and fault is not None:
                stub = TamperingStub(peer.stub, tamper_chunks(src, fault))
            with pytest.raises(StatusError) as info:
                await transfer(peer, src, transport, sender_agent, stub)
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)
            integrity = expected == grpc.StatusCode.ABORTED
            assert peer.integrity_failures == ([transport] if integrity else [])
            return info.value

    try:
        error = asyncio.run(scenario())
    finally:
        for a in (sender_agent, receiver_agent):
            if a is not None:
                a.close()
    assert error.code == expected, error
    assert not blocks(dst, range(NUM_BLOCKS)).any()  # refused blocks are scrubbed, the rest never written
    return error


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_block_that_lands_changed_is_refused_and_its_reservation_freed(
        transport: str, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    src, dst = make_pool(torch.bfloat16, True), make_pool(torch.bfloat16, False)
    with caplog.at_level(logging.WARNING, logger="kvtransfer.servicer"):
        error = run_refused(src, dst, transport, fault=fault)
    assert "KV digest mismatch" in error.message and f"(by {transport})" in error.message
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert "refused KV from peer ipv4:127.0.0.1:" in log
    assert ("(NIXL agent test-agent-" in log) == (transport == "nixl")


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2), (1, 4)], ids=["tp2-tp1", "tp1-tp2", "tp1-tp4"])
def test_each_receiving_rank_checks_the_head_slice_it_read(ranks: tuple[int, int]) -> None:
    """Heterogeneous tensor parallelism: a clean transfer passes every rank's check, and a bit
    flipped in the last receiving rank's heads is caught there and named by its (model) head."""
    src, dst = make_pool(torch.bfloat16, True, ranks[0]), make_pool(torch.bfloat16, False, ranks[1])
    sender_agent, receiver_agent = agent(src), agent(dst)

    async def clean() -> None:
        async with decode_worker(dst, nixl=receiver_agent) as peer:
            reservation = await transfer(peer, src, "nixl", sender_agent)
            assert peer.table.claim(reservation.reservation_id, "req-1") == DST_IDS
            assert peer.integrity_failures == []

    asyncio.run(clean())
    assert torch.equal(blocks(dst, DST_IDS), blocks(src, SRC_IDS))
    sender_agent.close()
    receiver_agent.close()
    error = run_refused(src, make_pool(torch.bfloat16, False, ranks[1]), "nixl", fault="flipped bit")
    last = dst.ranks[-1]
    flipped_head = last.first_head + (last.tensor[0].numel() * last.tensor.element_size() // 3) // dst.head_nbytes
    assert f"head {flipped_head}:" in error.message


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_a_sender_returning_random_bytes_is_refused_for_non_finite_kv(transport: str) -> None:
    """A prefill worker whose KV is garbage (random bit patterns) digests what it sends, so the
    digests match; its NaNs and infinities do not pass."""
    torch.manual_seed(0)
    src, dst = make_pool(torch.float32, False), make_pool(torch.float32, False)
    raw = src.ranks[0].tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    error = run_refused(src, dst, transport)
    assert "non-finite KV values" in error.message


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
@pytest.mark.parametrize("difference", ["dtype", "head_dim"])
def test_a_sender_of_another_kv_layout_is_refused_before_any_write(transport: str, difference: str) -> None:
    other = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4)  # head_dim 16, the same heads
    src = make_pool(torch.float8_e4m3fn, True) if difference == "dtype" else make_pool(torch.bfloat16, True,
                                                                                        config=other)
    dst = make_pool(torch.bfloat16, False)
    error = run_refused(src, dst, transport, expected=grpc.StatusCode.INVALID_ARGUMENT)
    assert ("layout" if transport == "nixl" else "expected") in error.message


def test_a_chunk_without_digests_is_refused_before_any_write() -> None:
    src, dst = make_pool(torch.bfloat16, True), make_pool(torch.bfloat16, False)

    async def strip(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
        chunk.block_digests = b""
        return chunk

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            with pytest.raises(StatusError) as info:
                await transfer(peer, src, "grpc", None, TamperingStub(peer.stub, strip))
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.message.startswith("block_digests: has 0 digests")
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)

    asyncio.run(scenario())
    assert not blocks(dst, range(NUM_BLOCKS)).any()


def test_wire_digests_are_each_ranks_heads_of_each_block() -> None:
    """The digests a 2-rank sender puts on the wire (per rank, no gather) equal those of the
    gathered whole blocks, block-major."""
    src = make_pool(torch.bfloat16, True, 2)
    assert pool_digests(src, SRC_IDS) == block_digests(src.gather(SRC_IDS))
    assert len(pool_digests(src, SRC_IDS)) == 8 * len(SRC_IDS) * CONFIG.num_key_value_heads
