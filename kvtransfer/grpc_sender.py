"""The prefill worker's side of ``DecodeWorker.TransferKV``: stream a request's blocks over gRPC.

Flow control is gRPC's own: each ``write`` waits until HTTP/2 flow control accepts the chunk,
and the next chunk is built only then, so at most one chunk (<= ``max_chunk_bytes``, or one
block if a block is larger) is held in memory per transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import grpc
import torch

from kvtransfer.errors import KVTransferError
from kvtransfer.transport import KVDestination
from kvtransfer.wire import BlockLayout, encode_chunk
from protos.tandem.v1 import kvtransfer_pb2, worker_pb2_grpc

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
DEFAULT_TIMEOUT_S = 30.0


def iter_chunks(
    kv_cache: torch.Tensor, block_ids: Sequence[int], *, reservation_id: str, request_id: str,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> Iterator[kvtransfer_pb2.KVChunk]:
    """Yield the request's blocks as chunks of as many whole blocks as fit in ``max_chunk_bytes``
    (at least one), in position order, built lazily.

    Args:
        kv_cache: ``[num_blocks, *block_shape]``, any device.
        block_ids: physical block of each position of the request.
        reservation_id, request_id: stamped on every chunk.
        max_chunk_bytes: byte budget of one chunk's data.

    Raises:
        ValueError: one block is larger than ``MAX_MESSAGE_BYTES``.
    """
    block_nbytes = BlockLayout.of_cache(kv_cache).block_nbytes
    if block_nbytes > MAX_MESSAGE_BYTES:
        raise ValueError(f"a block is {block_nbytes} bytes, over MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}")
    per_chunk = max(1, max_chunk_bytes // block_nbytes)
    for first in range(0, len(block_ids), per_chunk):
        ids = list(block_ids[first : first + per_chunk])
        if ids == list(range(ids[0], ids[0] + len(ids))):
            blocks = kv_cache[ids[0] : ids[0] + len(ids)]  # a contiguous run: no gather
        else:
            blocks = kv_cache[torch.tensor(ids, device=kv_cache.device)]
        yield encode_chunk(blocks, reservation_id=reservation_id, request_id=request_id, first_block_index=first)


async def send_blocks(
    stub: worker_pb2_grpc.DecodeWorkerStub, kv_cache: torch.Tensor, block_ids: Sequence[int], *,
    reservation_id: str, request_id: str, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> int:
    """Stream ``kv_cache[block_ids[i]]`` as block ``i`` of ``request_id`` into a reservation.

    Args:
        stub: a ``DecodeWorkerStub`` on an aio channel to the decode worker.
        kv_cache: the sender's cache, ``[num_blocks, *block_shape]``; the blocks must not
            change until this returns.
        block_ids: physical blocks of the request on the sender, in position order.
        reservation_id: from the decode worker's ``Admit``.
        request_id: the request.
        max_chunk_bytes: byte budget of one chunk (see ``iter_chunks``).
        timeout_s: deadline of the whole transfer, seconds; ``None``: none (the receiver's
            lease still bounds it).

    Returns:
        Blocks the receiver acknowledged.

    Raises:
        KVTransferError: with the call's status (the receiver's refusal, ``UNAVAILABLE``,
            ``DEADLINE_EXCEEDED``, ...); the receiver has released the reservation.
        asyncio.CancelledError: the caller was cancelled; the call is cancelled with it, which
            makes the receiver release the reservation.
    """
    chunks = iter_chunks(kv_cache, block_ids, reservation_id=reservation_id, request_id=request_id,
                         max_chunk_bytes=max_chunk_bytes)
    call = stub.TransferKV(timeout=timeout_s)
    try:
        try:
            for chunk in chunks:
                await call.write(chunk)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            # The call ended while we wrote (the receiver refused a chunk, the peer died). A
            # write racing the end reports a local INTERNAL or InvalidStateError; the call's
            # own status, awaited next, is the receiver's real answer.
            pass
        response = await call
    except grpc.aio.AioRpcError as exc:
        raise KVTransferError(exc.code(), exc.details() or "") from exc
    except BaseException:
        call.cancel()
        raise
    return response.num_blocks_received


class GrpcKVSender:
    """``KVSender`` over gRPC, across hosts; keeps one channel per decode worker address.

    Args:
        max_chunk_bytes: byte budget of one chunk.
        timeout_s: deadline of one transfer, seconds (``None``: none).
    """

    def __init__(self, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def send(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], destination: KVDestination, request_id: str
    ) -> int:
        """See ``KVSender.send``; ``KVTransferError`` carries the call's status."""
        channel = self._channels.get(destination.address)
        if channel is None:
            channel = grpc.aio.insecure_channel(destination.address, options=GRPC_MESSAGE_OPTIONS)
            self._channels[destination.address] = channel
        return await send_blocks(
            worker_pb2_grpc.DecodeWorkerStub(channel), kv_cache, block_ids,
            reservation_id=destination.reservation_id, request_id=request_id,
            max_chunk_bytes=self.max_chunk_bytes, timeout_s=self.timeout_s,
        )

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
