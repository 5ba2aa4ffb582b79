"""KV blocks over a real grpc.aio DecodeWorker on loopback: bit-exact delivery, and every failure
(corruption, bad chunk, lease expiry, sender gone) refused before any write with the
reservation's blocks handed back to the pool."""

import asyncio
import contextlib
import threading

import grpc
import numpy as np
import pytest
import torch

from engine.runner.kv_cache import KVCache
from kvtransfer import (
    GRPC_MESSAGE_OPTIONS, KVDestination, KVPool, KVReceiver, KVTransferClient, KVTransferStream, ReservationTable,
    decode_chunk, encode_chunk,
)
from kvtransfer.digest import pool_digests
from kvtransfer.nixl import NixlAgent
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2
from tests.helpers.kv_peers import (
    BLOCK_SIZE, CONFIG, DST_IDS, NUM_BLOCKS, SRC_IDS, TamperingStub, agent, blocks, decode_worker, make_pool,
    nixl_transfer, send_blocks, untouched, wait_for,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
@pytest.mark.parametrize("ranks", [(1, 1), (2, 1), (1, 4)], ids=["tp1-tp1", "tp2-tp1", "tp1-tp4"])
def test_blocks_arrive_bit_exact_in_reserved_slots(dtype: torch.dtype, blocks_per_chunk: int,
                                                   ranks: tuple[int, int]) -> None:
    """Whole blocks cross the stream whatever the two sides' tensor-parallel sizes; each
    receiving rank gets its own heads."""
    src, dst = make_pool(dtype, True, ranks[0]), make_pool(dtype, False, ranks[1])
    block_nbytes = KVCache.bytes_per_block(CONFIG, BLOCK_SIZE, dtype)

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            channel = grpc.aio.insecure_channel(peer.address, options=GRPC_MESSAGE_OPTIONS)
            sender = KVTransferClient(lambda address: channel, max_chunk_bytes=blocks_per_chunk * block_nbytes)
            try:
                async with sender.open(KVDestination(peer.address, reservation.reservation_id), "req-1") as transfer:
                    await transfer.send(src, 0, SRC_IDS[:1])  # as blocks become ready
                    await transfer.send(src, 1, SRC_IDS[1:])
                    acked = await transfer.finish()
            finally:
                await channel.close()
            assert acked == len(DST_IDS)
            assert peer.table.claim(reservation.reservation_id, "req-1") == DST_IDS
            assert peer.freed == []

    asyncio.run(scenario())
    assert torch.equal(blocks(dst, DST_IDS), blocks(src, SRC_IDS))
    assert not blocks(dst, untouched(dst, DST_IDS)).any()


def test_an_fp8_pool_says_so_in_its_layout_and_a_bfloat16_pool_refuses_its_blocks() -> None:
    """An fp8 pool (``kv_cache_dtype="fp8_e4m3"``) moves one byte per value, and its layout names
    the dtype, so its blocks never land in a bfloat16 pool as bytes of another meaning."""
    fp8, bf16 = make_pool(torch.float8_e4m3fn, True), make_pool(torch.bfloat16, False)
    assert fp8.layout.dtype_name == "float8_e4m3fn" and fp8.layout.to_proto().dtype == "float8_e4m3fn"
    assert 2 * fp8.layout.block_nbytes == bf16.layout.block_nbytes
    chunk = encode_chunk(fp8.gather(SRC_IDS[:1]), reservation_id="r", request_id="req-1", first_block_index=0)
    with pytest.raises(StatusError, match="dtype 'float8_e4m3fn' != expected 'bfloat16'"):
        decode_chunk(chunk, bf16.layout)
    receiver = KVReceiver(bf16, ReservationTable(lambda ids: None))
    reservation = receiver.table.reserve("req-1", DST_IDS)
    with pytest.raises(StatusError, match="float8_e4m3fn"):
        receiver.install(reservation.reservation_id, "req-1", 0, fp8.gather(SRC_IDS[:1]), b"")
    assert not blocks(bf16, range(NUM_BLOCKS)).any()


def test_corrupted_chunk_is_data_loss_and_frees_the_reservation() -> None:
    src, dst = make_pool(torch.bfloat16, True), make_pool(torch.bfloat16, False)

    async def flip_a_byte_of_second_chunk(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
        if i == 1:
            data = bytearray(chunk.data)
            data[len(data) // 2] ^= 0x40
            chunk.data = bytes(data)
        return chunk

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            stub = TamperingStub(peer.stub, flip_a_byte_of_second_chunk)
            with pytest.raises(StatusError) as info:
                await send_blocks(stub, src, SRC_IDS, reservation_id=reservation.reservation_id,
                                  request_id="req-1", max_chunk_bytes=1)
            assert info.value.code == grpc.StatusCode.DATA_LOSS and "CRC-32" in info.value.message
            assert sorted(peer.freed) == sorted(DST_IDS) and len(peer.table) == 0

    asyncio.run(scenario())
    # Block 0 arrived intact before the bad one; the corrupted block never reached the cache.
    assert torch.equal(blocks(dst, DST_IDS[:1]), blocks(src, SRC_IDS[:1]))
    assert not blocks(dst, DST_IDS[1:]).any()


def _bad_chunks(reservation_id: str, src: KVPool) -> dict[str, tuple[list[kvtransfer_pb2.KVChunk], str]]:
    def chunk(blocks: torch.Tensor, first: int, request_id: str = "req-1") -> kvtransfer_pb2.KVChunk:
        return encode_chunk(blocks, reservation_id=reservation_id, request_id=request_id, first_block_index=first)

    good = src.gather(SRC_IDS[:1])
    other = src.gather(SRC_IDS[1:2])
    small = KVCache(CONFIG, num_blocks=1, block_size=2, dtype=torch.float32, device="cpu").tensor
    return {
        "dtype": ([chunk(good.to(torch.float16), 0)], "dtype 'float16' != expected 'float32'"),
        "shape": ([chunk(small, 0)], "block_shape [4, 2, 2, 2, 8] != expected [4, 2, 2, 4, 8]"),
        "index": ([chunk(good, len(DST_IDS))], f"blocks [4, 5) outside [0, {len(DST_IDS)})"),
        "overrun": ([chunk(src.gather([0, 1]), len(DST_IDS) - 1)], "blocks [3, 5) outside"),
        "duplicate": ([chunk(good, 0), chunk(other, 0)], "blocks [0] of reservation"),
        "request": ([chunk(good, 0, request_id="someone-else")], "belongs to request 'req-1'"),
        "reservation": ([chunk(good, 0), encode_chunk(other, reservation_id="x", request_id="req-1",
                                                      first_block_index=1)], "in the stream of"),
    }


@pytest.mark.parametrize("case", ["dtype", "shape", "index", "overrun", "duplicate", "request", "reservation"])
def test_bad_chunk_is_refused_before_any_write(case: str) -> None:
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            chunks, text = _bad_chunks(reservation.reservation_id, src)[case]
            call = peer.stub.TransferKV(timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                for c in chunks:
                    await call.write(c)
                await call.done_writing()
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in info.value.details()
            assert sorted(peer.freed) == sorted(DST_IDS) and len(peer.table) == 0

    asyncio.run(scenario())
    written = blocks(dst, range(NUM_BLOCKS))
    if case in ("duplicate", "reservation"):  # the first, valid chunk landed; the bad one did not
        assert torch.equal(blocks(dst, DST_IDS[:1]), blocks(src, SRC_IDS[:1]))
        written = blocks(dst, untouched(dst, DST_IDS[:1]))
    assert not written.any()


def test_stream_ending_early_is_refused_and_frees() -> None:
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def drop_last(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk | None:
        return None if i == len(SRC_IDS) - 1 else chunk

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            with pytest.raises(StatusError) as info:
                await send_blocks(TamperingStub(peer.stub, drop_last), src, SRC_IDS,
                                  reservation_id=reservation.reservation_id, request_id="req-1", max_chunk_bytes=1)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "stream ended after 3 of 4 blocks" in info.value.message
            assert sorted(peer.freed) == sorted(DST_IDS) and len(peer.table) == 0

    asyncio.run(scenario())


def test_expired_lease_frees_blocks_and_refuses_the_late_transfer() -> None:
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def scenario() -> None:
        async with decode_worker(dst, lease_s=0.1) as peer:
            reaper = asyncio.create_task(peer.table.run_expiry(interval_s=0.02))
            reservation = peer.table.reserve("req-1", DST_IDS)
            await wait_for(lambda: len(peer.table) == 0)
            reaper.cancel()
            assert sorted(peer.freed) == sorted(DST_IDS)
            with pytest.raises(StatusError) as info:
                await send_blocks(peer.stub, src, SRC_IDS, reservation_id=reservation.reservation_id,
                                  request_id="req-1")
            assert info.value.code == grpc.StatusCode.NOT_FOUND and "expired" in info.value.message

    asyncio.run(scenario())
    assert not blocks(dst, range(NUM_BLOCKS)).any()


def test_sender_cancelled_mid_stream_frees_the_reservation() -> None:
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def scenario() -> None:
        stall = asyncio.Event()  # never set: the sender hangs after its first chunk

        async def stall_after_first(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
            if i == 1:
                await stall.wait()
            return chunk

        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            send = asyncio.create_task(send_blocks(
                TamperingStub(peer.stub, stall_after_first), src, SRC_IDS,
                reservation_id=reservation.reservation_id, request_id="req-1", max_chunk_bytes=1))
            await wait_for(lambda: reservation.num_arrived == 1)
            send.cancel()  # e.g. the prefill worker aborts the request
            with pytest.raises(asyncio.CancelledError):
                await send
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)

    asyncio.run(scenario())


def test_receiver_death_fails_the_sender_with_unavailable() -> None:
    """Whatever the write races (grpc.aio reports a stream broken under a write as a local
    INTERNAL about one time in five), the sender reports an unreachable destination."""
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def scenario() -> None:
        async with decode_worker(dst) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)

            async def kill_receiver_after_first(i: int, chunk: kvtransfer_pb2.KVChunk) -> kvtransfer_pb2.KVChunk:
                if i == 1:
                    await wait_for(lambda: reservation.num_arrived == 1)
                    await peer.server.stop(None)
                return chunk

            with pytest.raises(StatusError) as info:
                await send_blocks(TamperingStub(peer.stub, kill_receiver_after_first), src, SRC_IDS,
                                  reservation_id=reservation.reservation_id, request_id="req-1", max_chunk_bytes=1)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)

    for _ in range(25):
        asyncio.run(scenario())


def test_entering_a_transfer_does_not_wait_for_its_opening_and_a_failed_opening_reaches_send() -> None:
    """The prefill starts as the stream opens: entering returns while the opening message is not
    yet written (a destination that accepts the connection but never speaks HTTP/2), and the
    first ``send`` raises the stream's failure."""
    src = make_pool(torch.float32, True)

    async def scenario() -> None:
        accepted: list[asyncio.StreamWriter] = []
        silent = await asyncio.start_server(lambda reader, writer: accepted.append(writer), "127.0.0.1", 0)
        address = f"127.0.0.1:{silent.sockets[0].getsockname()[1]}"
        async with silent:
            async with grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS) as channel:
                transfer = KVTransferClient(lambda _: channel).open(KVDestination(address, "r-1"), "req-1",
                                                                    timeout_s=1.0)
                async with contextlib.AsyncExitStack() as stack:
                    await asyncio.wait_for(stack.enter_async_context(transfer), 0.5)  # before: until the deadline
                    with pytest.raises(StatusError) as info:
                        await transfer.send(src, 0, SRC_IDS)
            for writer in accepted:
                writer.close()
        # (the deadline, or UNAVAILABLE should gRPC give up on the handshake first)
        assert info.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), info.value
        assert transfer.num_sent == 0

    asyncio.run(scenario())


def test_open_stream_keeps_the_reservation_past_its_lease() -> None:
    """A prefill slower than the lease keeps its reservation: the open stream suspends the lease;
    once the stream ends the lease runs again, for the Decode claim."""
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)

    async def scenario() -> None:
        async with decode_worker(dst, lease_s=0.1) as peer:
            reaper = asyncio.create_task(peer.table.run_expiry(interval_s=0.02))
            reservation = peer.table.reserve("req-1", DST_IDS)
            async with KVTransferStream(peer.stub, reservation.reservation_id, "req-1") as transfer:
                await wait_for(lambda: reservation.attached)
                await asyncio.sleep(0.4)  # four leases with nothing sent: the prefill computes
                assert len(peer.table) == 1
                await transfer.send(src, 0, SRC_IDS)
                assert await transfer.finish() == len(DST_IDS)
            assert not reservation.attached and len(peer.table) == 1
            await wait_for(lambda: len(peer.table) == 0)  # nobody claimed it: the lease ends it
            reaper.cancel()
            assert sorted(peer.freed) == sorted(DST_IDS)

    asyncio.run(scenario())



@pytest.mark.parametrize("ranks", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2)])
def test_nixl_read_descriptors_take_each_head_range_from_the_rank_that_holds_it(ranks: tuple[int, int]) -> None:
    """Heterogeneous tensor parallelism: each receiving rank reads exactly its heads' span of
    each block, from each sending rank whose heads overlap them."""
    src, dst = make_pool(torch.float32, True, ranks[0]), make_pool(torch.float32, False, ranks[1])
    sender_agent, receiver_agent = agent(src), agent(dst)
    peer = receiver_agent.add_peer(sender_agent.source())
    local_spans, remote_spans = receiver_agent.read_spans(peer)
    local, remote = receiver_agent.read_indices(peer, [2, 3, 7], [4, 5, 0])
    pairs = len({(head * ranks[0] // 4, head * ranks[1] // 4) for head in range(4)})
    assert len(local_spans) == len(remote_spans) == pairs and len(local) == len(remote) == 3 * pairs

    def span(spans: np.ndarray, index: int) -> tuple[int, int]:
        """(address, bytes) of descriptor ``index`` of a strided list."""
        address, nbytes, _, stride, count = spans[index // spans[0, 4]].tolist()
        return address + (index % count) * stride, nbytes

    for i, j in zip(local.tolist(), remote.tolist()):
        (dst_addr, n), (src_addr, m) = span(local_spans, i), span(remote_spans, j)
        assert n == m
        # copy the span as NIXL would: the byte ranges lie inside the two pools' tensors
        src_part = next(p for p in src.ranks if p.tensor.data_ptr() <= src_addr < p.tensor.data_ptr() + p.tensor.nbytes)
        dst_part = next(p for p in dst.ranks if p.tensor.data_ptr() <= dst_addr < p.tensor.data_ptr() + p.tensor.nbytes)
        assert src_addr + n <= src_part.tensor.data_ptr() + src_part.tensor.nbytes
        assert dst_addr + n <= dst_part.tensor.data_ptr() + dst_part.tensor.nbytes
        src_bytes, dst_bytes = src_part.tensor.view(-1).view(torch.uint8), dst_part.tensor.view(-1).view(torch.uint8)
        so, do = src_addr - src_part.tensor.data_ptr(), dst_addr - dst_part.tensor.data_ptr()
        dst_bytes[do:do + n] = src_bytes[so:so + n]
    assert torch.equal(blocks(dst, [4, 5, 0]), blocks(src, [2, 3, 7]))
    assert not blocks(dst, untouched(dst, [4, 5, 0])).any()
    sender_agent.close()
    receiver_agent.close()


@pytest.mark.parametrize("lie", ["num_blocks", "base_address", "past the address space"])
def test_a_source_naming_memory_its_agent_did_not_register_is_refused(lie: str) -> None:
    """The sender's pool as announced must lie inside what its agent registered: checked once,
    when the receiver prepares the peer's reads, before any read is posted."""
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False, 2)
    sender_agent, receiver_agent = agent(src), agent(dst)
    source = sender_agent.source()
    if lie == "num_blocks":
        source.num_blocks *= 2
    elif lie == "base_address":
        source.ranks[0].base_address += src.ranks[0].tensor.nbytes
    else:  # the receiver's second rank reads from an offset past 2**64
        source.ranks[0].base_address = 2**64 - 1
    with pytest.raises(StatusError) as info:
        receiver_agent.add_peer(source)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "nixl_source.ranks" in info.value.message
    assert receiver_agent.add_peer(sender_agent.source()).num_span_pairs == 2  # the honest source still pairs
    sender_agent.close()
    receiver_agent.close()


def test_a_sender_agent_back_with_new_metadata_is_prepared_again_once_the_old_one_is_released() -> None:
    """A sender's agent known under its name but with other metadata (its pool registered anew)
    replaces the old one once no stream holds it: the old prepared reads are released and reads
    land from the new pool. While a stream holds the old one, the new one is refused."""
    old_pool, new_pool, dst = make_pool(torch.float32, True), make_pool(torch.float32, True), make_pool(torch.float32, False)
    receiver_agent, old_sender = agent(dst), NixlAgent("test-returning-sender", old_pool)
    old = receiver_agent.add_peer(old_sender.source())
    old_sender.close()
    new_sender = NixlAgent("test-returning-sender", new_pool)
    with pytest.raises(StatusError) as info:
        receiver_agent.add_peer(new_sender.source())
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    receiver_agent.release_peer(old)
    new = receiver_agent.add_peer(new_sender.source())
    assert new.metadata != old.metadata and new.remote_side is not old.remote_side

    async def scenario() -> None:
        async with new_sender.serving_reads():
            await receiver_agent.read(new, [2, 3, 7], [4, 5, 0])

    asyncio.run(scenario())
    assert torch.equal(blocks(dst, [4, 5, 0]), blocks(new_pool, [2, 3, 7]))
    assert receiver_agent.held_peers() == {new.name: 1}  # the read's hold ended with it
    new_sender.close()
    receiver_agent.close()


def test_a_sender_agent_no_one_holds_is_forgotten_when_another_is_added() -> None:
    """Prefill workers come and go: an agent that no stream or read has held for ``peer_idle_s``
    is forgotten (metadata and prepared reads) when another arrives; one still held never is."""
    dst = make_pool(torch.float32, False)
    senders = [agent(make_pool(torch.float32, True)) for _ in range(3)]
    receiver_agent = agent(dst)
    first, second = (receiver_agent.add_peer(sender.source()) for sender in senders[:2])
    receiver_agent.release_peer(first)
    receiver_agent.peer_idle_s = 3600.0
    third = receiver_agent.add_peer(senders[2].source())
    assert receiver_agent.held_peers() == {first.name: 0, second.name: 1, third.name: 1}  # not idle long enough
    receiver_agent.peer_idle_s = 0.0
    receiver_agent.release_peer(third)
    again = receiver_agent.add_peer(senders[0].source())  # forgets the third (idle), prepares the first anew
    assert receiver_agent.held_peers() == {second.name: 1, again.name: 1} and again.remote_side is not first.remote_side
    with pytest.raises(StatusError) as info:  # a forgotten peer's prepared reads are gone: no read from them
        asyncio.run(receiver_agent.read(first, [0], [0]))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    for sender in senders:
        sender.close()
    receiver_agent.close()


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "checksummed"])
@pytest.mark.parametrize("ranks", [(1, 1), (2, 1), (1, 2)], ids=["tp1-tp1", "tp2-tp1", "tp1-tp2"])
def test_nixl_reads_blocks_bit_exact_into_the_reserved_slots(verify: bool, ranks: tuple[int, int]) -> None:
    """The decode side reads the prefill side's blocks with NIXL (here UCX over host memory, as
    on a CPU machine); positions arrive in two announcements, as a prefill streams them."""
    src, dst = make_pool(torch.bfloat16, True, ranks[0]), make_pool(torch.bfloat16, False, ranks[1])
    sender_agent, receiver_agent = agent(src), agent(dst)

    async def scenario() -> None:
        async with decode_worker(dst, nixl=receiver_agent, verify_checksums=verify) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            channel = grpc.aio.insecure_channel(peer.address, options=GRPC_MESSAGE_OPTIONS)
            sender = KVTransferClient(lambda address: channel, transports=["nixl", "grpc"], nixl=sender_agent,
                                  verify_checksums=verify)
            destination = KVDestination(peer.address, reservation.reservation_id, kv_transports=("nixl", "grpc"))
            try:
                async with sender.open(destination, "req-1") as transfer:
                    assert transfer.transport == "nixl"
                    await transfer.send(src, 0, SRC_IDS[:2])
                    await transfer.send(src, 2, SRC_IDS[2:])
                    assert await transfer.finish() == len(DST_IDS)
            finally:
                await channel.close()
            assert peer.table.claim(reservation.reservation_id, "req-1") == DST_IDS and peer.freed == []
            await wait_for(lambda: set(receiver_agent.held_peers().values()) == {0})  # the stream's hold ends with it

    asyncio.run(scenario())
    assert torch.equal(blocks(dst, DST_IDS), blocks(src, SRC_IDS))
    assert not blocks(dst, untouched(dst, DST_IDS)).any()
    sender_agent.close()
    receiver_agent.close()


def test_a_host_memory_nixl_read_runs_off_the_event_loop() -> None:
    """Between host-memory pools UCX copies the bytes inside ``transfer`` itself: that call is
    made in another thread, so the worker's event loop serves its other streams meanwhile."""
    src, dst = make_pool(torch.bfloat16, True), make_pool(torch.bfloat16, False)
    sender_agent, receiver_agent = agent(src), agent(dst)
    transfer, transfer_threads = receiver_agent.agent.transfer, []

    def recorded_transfer(handle):
        transfer_threads.append(threading.get_ident())
        return transfer(handle)

    receiver_agent.agent.transfer = recorded_transfer

    async def scenario() -> None:
        peer = receiver_agent.add_peer(sender_agent.source())
        async with sender_agent.serving_reads():
            await receiver_agent.read(peer, SRC_IDS, DST_IDS)

    asyncio.run(scenario())
    assert len(transfer_threads) == 1 and transfer_threads[0] != threading.get_ident()
    assert torch.equal(blocks(dst, DST_IDS), blocks(src, SRC_IDS))
    sender_agent.close()
    receiver_agent.close()



@pytest.mark.parametrize("after", ["finish", "a duplicate announcement"])
def test_nixl_acknowledgement_comes_by_notification_and_hands_the_reservation_over(after: str) -> None:
    """The read that completes the reservation is acknowledged by a NIXL notification while the
    stream is still open; from then on the reservation is the request's, under its lease: the
    stream failing afterwards (here a duplicate announcement, refused) does not free it."""
    src, dst = make_pool(torch.bfloat16, True), make_pool(torch.bfloat16, False)
    sender_agent, receiver_agent = agent(src), agent(dst)

    async def scenario() -> None:
        async with decode_worker(dst, nixl=receiver_agent) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            async with nixl_transfer(peer, sender_agent, reservation.reservation_id) as transfer:
                await transfer.send(src, 0, SRC_IDS)
                await wait_for(lambda: transfer.acknowledged)
                assert reservation.complete and not reservation.attached  # the lease runs again
                if after == "finish":
                    assert await transfer.finish() == len(DST_IDS) and transfer.acknowledged_by == "nixl"
                else:
                    await transfer.send(src, 0, SRC_IDS[:1])
                    await wait_for(transfer._call.done)
                    assert await transfer._call.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert len(peer.table) == 1 and peer.freed == []
            assert peer.table.claim(reservation.reservation_id, "req-1") == DST_IDS

    asyncio.run(scenario())
    assert torch.equal(blocks(dst, DST_IDS), blocks(src, SRC_IDS))
    sender_agent.close()
    receiver_agent.close()


def test_nixl_refusal_reaches_finish_as_the_stream_status() -> None:
    """No acknowledgement comes for a refused read: ``finish`` raises the stream's status."""
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)
    sender_agent, receiver_agent = agent(src), agent(dst)

    async def scenario() -> None:
        async with decode_worker(dst, nixl=receiver_agent) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            with pytest.raises(StatusError) as info:
                async with nixl_transfer(peer, sender_agent, reservation.reservation_id) as transfer:
                    await transfer.send(src, len(DST_IDS), SRC_IDS[:1])  # a position outside the reservation
                    await transfer.finish()
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and not transfer.acknowledged
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)

    asyncio.run(scenario())
    sender_agent.close()
    receiver_agent.close()


@pytest.mark.parametrize("case", ["checksum", "outside the pool", "no nixl here"])
def test_nixl_refusals_free_the_reservation(case: str) -> None:
    src, dst = make_pool(torch.float32, True), make_pool(torch.float32, False)
    sender_agent, receiver_agent = agent(src), agent(dst)
    expected = {"checksum": grpc.StatusCode.DATA_LOSS, "outside the pool": grpc.StatusCode.INVALID_ARGUMENT,
                "no nixl here": grpc.StatusCode.FAILED_PRECONDITION}[case]

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack, decode_worker(
                dst, nixl=None if case == "no nixl here" else receiver_agent, verify_checksums=True) as peer:
            reservation = peer.table.reserve("req-1", DST_IDS)
            call = KVTransferStream(peer.stub, reservation.reservation_id, "req-1")._call
            await stack.enter_async_context(sender_agent.serving_reads())
            ids = [100] + SRC_IDS[1:] if case == "outside the pool" else SRC_IDS
            digests = pool_digests(src, SRC_IDS)
            # A write racing the receiver's refusal fails locally (INTERNAL "Internal error from
            # Core", or InvalidStateError); the call's own status, awaited last, is the answer.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(kvtransfer_pb2.KVChunk(reservation_id=reservation.reservation_id, request_id="req-1",
                                                        nixl_source=sender_agent.source(), layout=src.layout.to_proto()))
                await call.write(kvtransfer_pb2.KVChunk(
                    reservation_id=reservation.reservation_id, request_id="req-1", first_block_index=0,
                    num_blocks=len(ids), source_block_ids=ids, block_digests=digests, crc32=12345, has_crc32=True))
                await call.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == expected, info.value
            await wait_for(lambda: len(peer.table) == 0)
            assert sorted(peer.freed) == sorted(DST_IDS)
            await wait_for(lambda: set(receiver_agent.held_peers().values()) <= {0})  # the stream let go of its peer

    asyncio.run(scenario())
    sender_agent.close()
    receiver_agent.close()


def test_no_transport_in_common_is_a_clear_error() -> None:
    sender = KVTransferClient(lambda address: None, transports=["nixl"], nixl=None)
    with pytest.raises(StatusError) as info:
        sender.open(KVDestination("decode:1", "r", kv_transports=("grpc",)), "req-1")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no KV transport in common" in info.value.message
