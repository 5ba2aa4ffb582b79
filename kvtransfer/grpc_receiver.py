"""The decode worker's side of ``DecodeWorker.TransferKV``: a client stream of ``KVChunk``s."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvtransfer.errors import KVTransferError
from kvtransfer.receiver import KVReceiver
from kvtransfer.wire import decode_chunk
from protos.tandem.v1 import kvtransfer_pb2


class GrpcKVReceiver:
    """Serves ``TransferKV`` streams into a ``KVReceiver``.

    The decode worker's servicer delegates to it::

        async def TransferKV(self, request_iterator, context):
            return await self.kv_receiver.transfer_kv(request_iterator, context)

    One stream carries every block of one reservation (any order, any grouping). The
    reservation is released (blocks back to the pool) when a chunk is rejected, when the stream
    ends before every block arrived, and when the call dies (sender cancels or crashes, the
    deadline passes): the handler is cancelled and releases on its way out.
    """

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    async def transfer_kv(
        self, request_iterator: AsyncIterator[kvtransfer_pb2.KVChunk], context: grpc.aio.ServicerContext
    ) -> kvtransfer_pb2.TransferKVResponse:
        """Receive one reservation's blocks.

        Returns:
            ``TransferKVResponse`` once every block has arrived and the sender closed the stream.

        Raises:
            grpc.aio.AbortError: via ``context.abort``, with ``INVALID_ARGUMENT`` (empty stream,
                chunk of another reservation, a chunk that does not fit, stream ended early),
                ``DATA_LOSS`` (checksum) or ``NOT_FOUND`` (unknown or expired reservation).
        """
        table = self.receiver.table
        reservation_id: str | None = None
        try:
            async for chunk in request_iterator:
                if reservation_id is None:
                    reservation_id = chunk.reservation_id
                elif chunk.reservation_id != reservation_id:
                    raise KVTransferError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"chunk for reservation {chunk.reservation_id!r} in the stream of {reservation_id!r}")
                blocks = decode_chunk(chunk, self.receiver.layout)
                self.receiver.install(reservation_id, chunk.request_id, chunk.first_block_index, blocks)
            if reservation_id is None:
                raise KVTransferError(grpc.StatusCode.INVALID_ARGUMENT, "empty TransferKV stream")
            reservation = table.get(reservation_id)
            if not reservation.complete:
                raise KVTransferError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"stream ended after {reservation.num_arrived} of {reservation.num_blocks} blocks "
                    f"of reservation {reservation_id!r}")
            return kvtransfer_pb2.TransferKVResponse(num_blocks_received=reservation.num_blocks)
        except KVTransferError as exc:
            if reservation_id is not None:
                table.release(reservation_id, exc.message)
            await context.abort(exc.code, exc.message)
        except BaseException:
            # Cancelled (sender gone, deadline passed) or a bug: the sender sees a failed
            # transfer, so the reservation is over even if every block had arrived.
            if reservation_id is not None:
                table.release(reservation_id, "TransferKV call ended before completing")
            raise
