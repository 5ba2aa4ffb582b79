"""The prefill worker's side of ``DecodeWorker.TransferKV``: a request's blocks, by gRPC or NIXL.

A :class:`KVTransferStream` is one open stream into one reservation. Opening it first (before a
single block is ready) keeps the reservation alive while the prefill computes; entering it does
not wait for the opening message to be written (0.3-0.4 ms on a quiet host, longer behind a busy
event loop), so the prefill starts at once and a failed opening surfaces at the first
:meth:`~KVTransferStream.send` or at :meth:`~KVTransferStream.finish`. Blocks are then
announced as they become ready, in any grouping, and :meth:`KVTransferStream.finish` waits for
the receiver's acknowledgement, which it sends once it holds every block. Every chunk carries
the end-to-end digests of its blocks (:mod:`kvtransfer.digest`). Over ``"grpc"`` the chunks
carry the blocks' bytes; flow control is gRPC's own (each ``write`` waits until HTTP/2 accepts
the chunk, and the next chunk is built only then, so at most one chunk of <= ``max_chunk_bytes``
is held in memory). Over ``"nixl"`` they carry only the sender's block ids (the opening message
carries the pool's block layout), and the receiver reads the blocks from the sender's pool
(:mod:`kvtransfer.nixl`); the blocks must stay pinned until :meth:`KVTransferStream.finish`
returns, which it does on the receiver's acknowledgement by NIXL notification or on the
stream's answer, whichever comes first (the stream is then closed in the background).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvtransfer.digest import pool_digests
from kvtransfer.nixl import NixlAgent
from kvtransfer.pool import KVPool
from kvtransfer.transport import KVDestination
from kvtransfer.wire import blocks_crc32, encode_chunk
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# One chunk stays under gRPC's default 4 MiB message limit whenever a block does.
DEFAULT_MAX_CHUNK_BYTES = 2 << 20
# Above any single block we serve (an 8 MiB block for 126 layers x 8 KV heads x 128 x bf16).
MAX_MESSAGE_BYTES = 64 << 20
# For the decode worker's server and the prefill worker's channels: a chunk is at least one
# block, which may exceed gRPC's default 4 MiB message limit.
GRPC_MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# What a stream broken under the sender reports instead of the receiver's answer: grpc.aio gives
# a call whose write failed in the transport (the receiver gone, or frozen past keepalive) the
# local status INTERNAL "Internal error from Core" (measured: 8 of 40 receivers stopped
# mid-stream, the rest UNAVAILABLE), and a receiver's server that stops cancels its calls. The
# receiver answers neither itself: to the prefill worker's caller both mean an unreachable
# destination, UNAVAILABLE (which the gateway retries elsewhere).
_BROKEN_STREAM = {grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}


def iter_chunks(
    pool: KVPool, first_index: int, block_ids: Sequence[int], *, reservation_id: str, request_id: str,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[kvtransfer_pb2.KVChunk]:
    """Yield blocks as chunks of as many whole blocks as fit in ``max_chunk_bytes`` (at least
    one), in position order, built lazily.

    Args:
        pool: the sender's KV pool (every rank's heads of a block go in the chunk).
        first_index: the request's block position of ``block_ids[0]``.
        block_ids: physical blocks on the sender, for positions ``first_index, first_index + 1, ...``.
        reservation_id, request_id: stamped on every chunk.
        max_chunk_bytes: byte budget of one chunk's data.

    Raises:
        ValueError: one block is larger than ``MAX_MESSAGE_BYTES``.
    """
    block_nbytes = pool.layout.block_nbytes
    if block_nbytes > MAX_MESSAGE_BYTES:
        raise ValueError(f"a block is {block_nbytes} bytes, over MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    per_chunk = max(1, max_chunk_bytes // block_nbytes)
    for start in range(0, len(block_ids), per_chunk):
        yield encode_chunk(pool.gather(block_ids[start : start + per_chunk]), reservation_id=reservation_id,
                           request_id=request_id, first_block_index=first_index + start)


class KVTransferStream:
    """One ``TransferKV`` stream into one reservation; an async context manager.

    Leaving the context without :meth:`finish` (an error, a cancellation) cancels the call,
    which makes the receiver release the reservation.

    Args:
        stub: a ``DecodeWorkerStub`` on an aio channel to the decode worker.
        reservation_id: from the decode worker's ``Admit``.
        request_id: the request (checked against the reservation).
        max_chunk_bytes: byte budget of one chunk (see :func:`iter_chunks`).
        timeout_s: deadline of the whole stream, seconds; ``None``: none (the caller's own
            deadline, or its cancellation, bounds it).
        nixl: the sender's NIXL agent, for the receiver to read the blocks from its pool
            (progressed while the stream is open); ``None``: the blocks' bytes travel in the
            stream (gRPC).
        verify_checksums: over NIXL, send a CRC-32 of each chunk's blocks for the receiver to
            check (a debug setting: a device-to-host copy of every block). Always on over gRPC.
    """

    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub, reservation_id: str, request_id: str, *,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, timeout_s: float | None = None,
                 nixl: NixlAgent | None = None, verify_checksums: bool = False) -> None:
        self.reservation_id = reservation_id
        self.request_id = request_id
        self.max_chunk_bytes = max_chunk_bytes
        self.nixl = nixl
        self.nixl_source = nixl.source() if nixl is not None else None
        self._serving = contextlib.AsyncExitStack()
        self.verify_checksums = verify_checksums
        self.num_sent = 0
        self.acknowledged_by: str | None = None  # "nixl" (notification) or "grpc" (the stream's answer)
        self._call = stub.TransferKV(timeout=timeout_s)
        self._finished = False
        self._ack: asyncio.Future[int] | None = None
        self._opening: asyncio.Future[None] | None = None  # the opening message's write

    @property
    def transport(self) -> str:
        """``"nixl"`` or ``"grpc"``."""
        return "nixl" if self.nixl_source is not None else "grpc"

    @property
    def acknowledged(self) -> bool:
        """Whether the receiver's acknowledgement by NIXL notification has arrived (every block
        read; the sender's blocks may be unpinned)."""
        return self._ack is not None and self._ack.done()

    async def __aenter__(self) -> KVTransferStream:
        if self.nixl is not None:
            await self._serving.enter_async_context(self.nixl.serving_reads())
            self._ack = self.nixl.expect_acknowledgement(self.reservation_id)
            self._serving.callback(self.nixl.forget_acknowledgement, self.reservation_id)
        layout = self.nixl.pool.layout.to_proto() if self.nixl is not None else None
        self._opening = asyncio.ensure_future(self._write(kvtransfer_pb2.KVChunk(
            reservation_id=self.reservation_id, request_id=self.request_id, nixl_source=self.nixl_source,
            layout=layout)))
        self._opening.add_done_callback(lambda task: task.cancelled() or task.exception())  # raised by send/finish
        return self

    async def __aexit__(self, *exc) -> None:
        if not self._finished:
            self._call.cancel()
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        await self._serving.aclose()

    async def send(self, pool: KVPool, first_index: int, block_ids: Sequence[int]) -> None:
        """Send ``pool``'s blocks ``block_ids[i]`` as the request's block ``first_index + i``.

        Args:
            pool: the sender's KV pool; the blocks must not change until this returns.

        Raises:
            StatusError: the call failed (the receiver refused a chunk or the opening, the peer
                died, ...), with the receiver's status; ``UNAVAILABLE`` where the stream broke.
        """
        await self._opening  # (raises where the opening failed)
        if self.nixl_source is not None:
            chunk = kvtransfer_pb2.KVChunk(reservation_id=self.reservation_id, request_id=self.request_id,
                                           first_block_index=first_index, num_blocks=len(block_ids),
                                           source_block_ids=block_ids, block_digests=pool_digests(pool, block_ids))
            if self.verify_checksums:
                chunk.crc32, chunk.has_crc32 = blocks_crc32(pool.gather(block_ids)), True
            await self._write(chunk)
        else:
            for chunk in iter_chunks(pool, first_index, block_ids, reservation_id=self.reservation_id,
                                     request_id=self.request_id, max_chunk_bytes=self.max_chunk_bytes):
                await self._write(chunk)
        self.num_sent += len(block_ids)

    async def finish(self) -> int:
        """Close the stream and wait for the receiver's acknowledgement: over NIXL, its
        notification or the stream's answer, whichever comes first; over gRPC, the answer.

        Returns:
            Blocks the receiver acknowledged (the whole reservation).

        Raises:
            StatusError: the receiver refused the transfer (e.g. blocks missing), or the call
                failed (``UNAVAILABLE`` where the stream broke).
        """
        await self._opening  # (raises where the opening failed)
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call already ended: its status, awaited below, says why
        answer = asyncio.ensure_future(self._status())
        try:
            if self._ack is not None:
                num_blocks = await self.nixl.wait_acknowledgement(self._ack, answer)
                if num_blocks is not None:
                    self._finished, self.acknowledged_by = True, "nixl"
                    answer.add_done_callback(_closed_after_acknowledgement)
                    return num_blocks
            response = await answer
        finally:
            if not self._finished:
                answer.cancel()  # (cancelled ourselves: leaving the context cancels the call)
        self._finished, self.acknowledged_by = True, "grpc"
        return response.num_blocks_received

    async def _write(self, chunk: kvtransfer_pb2.KVChunk) -> None:
        try:
            await self._call.write(chunk)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The call ended while we wrote (the receiver refused a chunk, the peer died). A
            # write racing the end reports a local INTERNAL or InvalidStateError; the call's
            # own status is the receiver's real answer.
            await self._status()
            raise StatusError(grpc.StatusCode.INTERNAL, "the transfer stream ended without a status") from None

    async def _status(self) -> kvtransfer_pb2.TransferKVResponse:
        try:
            return await self._call
        except grpc.aio.AioRpcError as exc:
            self._finished = True
            code = grpc.StatusCode.UNAVAILABLE if exc.code() in _BROKEN_STREAM else exc.code()
            raise StatusError(code, exc.details() or "") from exc


def _closed_after_acknowledgement(answer: asyncio.Future) -> None:
    """The stream's answer after the receiver acknowledged by notification: nothing waits for it
    any more; a failure now (the receiver gone meanwhile) is only logged."""
    if not answer.cancelled() and answer.exception() is not None:
        logger.info("a KV transfer stream failed after its acknowledgement: %s", answer.exception())


class KVTransferClient:
    """Opens :class:`KVTransferStream` streams to decode workers, by NIXL where both sides have it.

    Args:
        channel: the channel to a decode worker's address (the caller's channel cache; its
            channels must allow messages of ``MAX_MESSAGE_BYTES``, see ``GRPC_MESSAGE_OPTIONS``).
        transports: the transports this worker sends with, preferred first (``"nixl"`` needs
            ``nixl``).
        nixl: this worker's NIXL agent, its pool registered.
        verify_checksums: see :class:`KVTransferStream`.
        max_chunk_bytes: byte budget of one chunk.
    """

    def __init__(self, channel: Callable[[str], grpc.aio.Channel], *, transports: Sequence[str] = ("grpc",),
                 nixl: NixlAgent | None = None, verify_checksums: bool = False,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES) -> None:
        self.channel = channel
        self.transports = list(transports)
        self.nixl = nixl
        self.verify_checksums = verify_checksums
        self.max_chunk_bytes = max_chunk_bytes

    def choose_transport(self, destination: KVDestination) -> str:
        """The first of this worker's transports the destination takes.

        Raises:
            StatusError: ``FAILED_PRECONDITION`` when they share none (e.g. a worker configured
                for NIXL only, and a receiver without it): a clear error, never a silent slow path.
        """
        for transport in self.transports:
            if transport in destination.kv_transports:
                return transport
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"no KV transport in common: this worker sends by {self.transports}, the decode worker "
                          f"at {destination.address} takes {list(destination.kv_transports)}")

    def open(self, destination: KVDestination, request_id: str, timeout_s: float | None = None) -> KVTransferStream:
        """A transfer into ``destination``'s reservation (enter it with ``async with``).

        Raises:
            StatusError: ``FAILED_PRECONDITION``, no transport in common.
        """
        transport = self.choose_transport(destination)
        stub = worker_pb2_grpc.DecodeWorkerStub(self.channel(destination.address))
        return KVTransferStream(stub, destination.reservation_id, request_id, max_chunk_bytes=self.max_chunk_bytes,
                              timeout_s=timeout_s, nixl=self.nixl if transport == "nixl" else None,
                              verify_checksums=self.verify_checksums)
