"""The receive side of every transport: check arriving blocks, then write them into their slots."""

from __future__ import annotations

import grpc
import torch

from kvtransfer.errors import KVTransferError
from kvtransfer.reservations import Reservation, ReservationTable
from kvtransfer.wire import BlockLayout


class KVReceiver:
    """Installs a request's incoming blocks into the decode worker's cache.

    Args:
        kv_cache: the worker's cache tensor, ``[num_blocks, *block_shape]`` (``KVCache.tensor``).
        table: the worker's reservations of blocks in that cache.
    """

    def __init__(self, kv_cache: torch.Tensor, table: ReservationTable) -> None:
        self.kv_cache = kv_cache
        self.table = table
        self.layout = BlockLayout.of_cache(kv_cache)

    def install(
        self, reservation_id: str, request_id: str, first_index: int, blocks: torch.Tensor
    ) -> Reservation:
        """Write ``blocks[j]`` into the slot reserved for the request's block ``first_index + j``.

        Every check (dtype, shape, reservation, request, range, duplicates, lease) passes before
        a byte is written. Any failure releases the reservation: a transfer with one bad chunk
        is over, and its blocks go back to the pool.

        Args:
            reservation_id: the reservation.
            request_id: the request it must belong to.
            first_index: position of ``blocks[0]`` among the request's blocks.
            blocks: ``[count, *layout.block_shape]`` of ``layout.dtype``, any device.

        Returns:
            The reservation, updated (check ``complete``).

        Raises:
            KVTransferError: ``INVALID_ARGUMENT`` (wrong dtype/shape, request, range, duplicate),
                ``NOT_FOUND`` (unknown or expired reservation).
        """
        try:
            shape = tuple(blocks.shape[1:])
            if blocks.dtype != self.layout.dtype or shape != self.layout.block_shape:
                raise KVTransferError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"blocks {blocks.dtype} {list(shape)} do not match the cache's "
                    f"{self.layout.dtype} {list(self.layout.block_shape)}")
            count = blocks.shape[0]
            block_ids = self.table.check_arrival(reservation_id, request_id, first_index, count)
            # No await between the check and the write: the slots cannot be freed in between.
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
            self.kv_cache.index_copy_(0, index, blocks.to(self.kv_cache.device))
            return self.table.mark_arrived(reservation_id, first_index, count)
        except KVTransferError as exc:
            self.table.release(reservation_id, exc.message)
            raise
