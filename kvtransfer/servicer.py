"""The decode worker's side of ``DecodeWorker.TransferKV``: a client stream of ``KVChunk``s,
carrying the blocks' bytes (gRPC) or where to read them from (NIXL)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from kvtransfer.digest import KVIntegrityError
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservations import Reservation
from kvtransfer.wire import BlockLayout, decode_chunk
from protos.status import StatusError
from protos.tandem.v1 import kvtransfer_pb2

logger = logging.getLogger(__name__)


class KVTransferServicer:
    """Serves ``TransferKV`` streams into a ``KVReceiver``.

    The decode worker's servicer delegates to it::

        async def TransferKV(self, request_iterator, context):
            response, transport = await self.kv_receiver.transfer_kv(request_iterator, context)
            return response

    One stream carries every block of one reservation that is not already cached (any order,
    any grouping). Its first message attaches the stream to the reservation, suspending the
    reservation's lease while the stream is open (a chunk of no blocks may open the stream
    before any block is ready, as a prefill worker does before it computes); with NIXL it names
    the sender's pool (``nixl_source``), and each later chunk lists the sender's blocks to read
    (``source_block_ids``) instead of carrying them. The reservation is released (blocks back to
    the pool, after any read in flight) when a chunk is rejected, when the stream ends before
    every block arrived, and when the call dies (sender cancels or crashes, the deadline
    passes): the handler is cancelled and releases on its way out.

    Over NIXL, the read that completes the reservation is acknowledged at once by a NIXL
    notification (:meth:`kvtransfer.nixl.NixlAgent.acknowledge`), before the stream's answer:
    from then on the reservation is no longer the stream's but the request's, under its lease
    again (detached), and it stays whatever becomes of the stream (the sender may have acted on
    the acknowledgement already); a ``Decode`` claims it, or the lease frees it.

    Blocks that do not match the sender's digests where they landed (or hold NaN / infinity)
    end the stream with ``ABORTED`` (:class:`~kvtransfer.digest.KVIntegrityError`), logged with
    the sender's identity and reported to ``on_integrity_failure``.

    Args:
        receiver: where the blocks go.
        on_integrity_failure: called with the transport (``"nixl"``, ``"grpc"``) of each stream
            refused for a digest mismatch or a non-finite value (e.g. a metric's ``inc``).
    """

    def __init__(self, receiver: KVReceiver,
                 on_integrity_failure: Callable[[str], None] = lambda transport: None) -> None:
        self.receiver = receiver
        self.on_integrity_failure = on_integrity_failure

    async def transfer_kv(
        self, request_iterator: AsyncIterator[kvtransfer_pb2.KVChunk], context: grpc.aio.ServicerContext
    ) -> tuple[kvtransfer_pb2.TransferKVResponse, str]:
        """Receive one reservation's blocks.

        Returns:
            ``TransferKVResponse`` once every block has arrived and the sender closed the
            stream, and the transport the blocks came by (``"nixl"`` or ``"grpc"``).

        Raises:
            grpc.aio.AbortError: via ``context.abort``, with ``INVALID_ARGUMENT`` (empty stream,
                chunk of another reservation, a chunk that does not fit, stream ended early),
                ``DATA_LOSS`` (checksum), ``ABORTED`` (digest mismatch or non-finite KV where the
                blocks landed) or ``NOT_FOUND`` (unknown or expired reservation).
        """
        table = self.receiver.table
        reservation_id: str | None = None
        peer = None
        acknowledged = False
        try:
            async for chunk in request_iterator:
                if reservation_id is None:
                    reservation_id = chunk.reservation_id
                    table.attach(reservation_id, chunk.request_id)
                    if chunk.HasField("nixl_source"):
                        if self.receiver.nixl is None:
                            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                                              "this worker receives KV over gRPC only (no NIXL)")
                        self._check_layout(chunk)
                        peer = self.receiver.nixl.add_peer(chunk.nixl_source)
                    if chunk.num_blocks == 0 and not chunk.data:
                        continue  # the stream's opening, before any block is ready
                elif chunk.reservation_id != reservation_id:
                    raise StatusError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"chunk for reservation {chunk.reservation_id!r} in the stream of {reservation_id!r}")
                if peer is not None:
                    reservation = await self._read(reservation_id, chunk, peer)
                    if reservation.complete and not acknowledged:
                        table.detach(reservation_id)
                        acknowledged = self.receiver.nixl.acknowledge(peer, reservation_id, reservation.num_blocks)
                else:
                    blocks = decode_chunk(chunk, self.receiver.layout)
                    self.receiver.install(reservation_id, chunk.request_id, chunk.first_block_index, blocks,
                                          chunk.block_digests)
            if reservation_id is None:
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, "empty TransferKV stream")
            if acknowledged:  # (the request may have claimed the reservation already)
                return kvtransfer_pb2.TransferKVResponse(num_blocks_received=reservation.num_blocks), "nixl"
            reservation = table.get(reservation_id)
            if not reservation.complete:
                raise StatusError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"stream ended after {reservation.num_arrived} of {reservation.num_blocks} blocks "
                    f"of reservation {reservation_id!r}")
            table.detach(reservation_id)
            return (kvtransfer_pb2.TransferKVResponse(num_blocks_received=reservation.num_blocks),
                    "nixl" if peer is not None else "grpc")
        except StatusError as exc:
            if reservation_id is not None and not acknowledged:
                table.release(reservation_id, exc.message)
            if isinstance(exc, KVIntegrityError):
                transport = "nixl" if peer is not None else "grpc"
                logger.warning("refused KV from %s: %s", _sender(context, peer), exc.message)
                self.on_integrity_failure(transport)
            await context.abort(exc.code, exc.message)
        except BaseException:
            # Cancelled (sender gone, deadline passed) or a bug: unless acknowledged, the sender
            # sees a failed transfer, so the reservation is over even if every block had arrived.
            if reservation_id is not None and not acknowledged:
                table.release(reservation_id, "TransferKV call ended before completing")
            raise
        finally:
            if peer is not None:
                self.receiver.nixl.release_peer(peer)

    async def _read(self, reservation_id: str, chunk: kvtransfer_pb2.KVChunk, peer) -> Reservation:
        """Read the chunk's blocks over NIXL; a cancellation waits for the read's end (shielded),
        so the reservation's slots are not freed under a transfer in flight. Returns the
        reservation, updated."""
        if chunk.data or chunk.num_blocks != len(chunk.source_block_ids) or not chunk.num_blocks:
            raise StatusError.invalid_argument(
                "source_block_ids", f"a NIXL chunk lists one source block per position and no data, got "
                                    f"{len(chunk.source_block_ids)} for num_blocks={chunk.num_blocks}")
        read = asyncio.ensure_future(self.receiver.read(
            reservation_id, chunk.request_id, chunk.first_block_index, peer, list(chunk.source_block_ids),
            chunk.block_digests, chunk.crc32 if chunk.has_crc32 else None))
        read.add_done_callback(lambda task: task.cancelled() or task.exception())  # observed by the await
        return await asyncio.shield(read)

    def _check_layout(self, opening: kvtransfer_pb2.KVChunk) -> None:
        """A NIXL sender's pool must hold blocks of this pool's layout: reading another layout's
        spans would land other bytes than the sender digested (refused up front, clearly).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` naming ``layout``.
        """
        layout = BlockLayout.from_proto(opening.layout)
        if layout != self.receiver.layout:
            raise StatusError.invalid_argument(
                "layout", f"the sender's blocks are {layout.dtype_name} {list(layout.block_shape)}, this "
                          f"worker's {self.receiver.layout.dtype_name} {list(self.receiver.layout.block_shape)}")


def _sender(context: grpc.aio.ServicerContext, peer) -> str:
    """Who sent a stream, for the log: its address, the names its verified certificate carries
    (with mTLS) and its NIXL agent (which names its worker)."""
    auth = context.auth_context()
    names = sorted({name.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
                    for name in auth.get(key, [])})
    who = f"peer {context.peer()}"
    if names:
        who += f" (certificate {', '.join(names)})"
    if peer is not None:
        who += f" (NIXL agent {peer.name})"
    return who
