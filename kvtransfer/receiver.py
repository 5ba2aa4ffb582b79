"""The receive side of every transport: check arriving blocks, then write them into their slots."""

from __future__ import annotations

import grpc
import torch

from kvtransfer.nixl import NixlAgent
from kvtransfer.pool import KVPool
from kvtransfer.reservations import Reservation, ReservationTable
from kvtransfer.wire import blocks_crc32
from protos.status import StatusError


class KVReceiver:
    """Installs a request's incoming blocks into the decode worker's cache: bytes that came in
    a chunk (gRPC), or read from the sender's pool (NIXL).

    Args:
        pool: the worker's KV pool (every rank's part).
        table: the worker's reservations of blocks in that pool.
        nixl: the worker's NIXL agent (``None``: gRPC transfers only).
        verify_checksums: on the NIXL path, compare a CRC-32 of the blocks read with the
            sender's (a debug setting: it copies every block to the host on both sides).
    """

    def __init__(self, pool: KVPool, table: ReservationTable, nixl: NixlAgent | None = None,
                 verify_checksums: bool = False) -> None:
        self.pool = pool
        self.table = table
        self.layout = pool.layout
        self.nixl = nixl
        self.verify_checksums = verify_checksums

    @property
    def transports(self) -> list[str]:
        """The transports this receiver takes, preferred first."""
        return ["nixl", "grpc"] if self.nixl is not None else ["grpc"]

    def install(self, reservation_id: str, request_id: str, first_index: int, blocks: torch.Tensor) -> Reservation:
        """Write ``blocks[j]`` into the slot reserved for the request's block ``first_index + j``.

        Every check (dtype, shape, reservation, request, range, duplicates, lease) passes before
        a byte is written.

        Args:
            reservation_id: the reservation.
            request_id: the request it must belong to.
            first_index: position of ``blocks[0]`` among the request's blocks.
            blocks: ``[count, *layout.block_shape]`` of ``layout.dtype``, any device.

        Returns:
            The reservation, updated (check ``complete``).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` (wrong dtype/shape, request, range, duplicate),
                ``NOT_FOUND`` (unknown or expired reservation).
        """
        shape = tuple(blocks.shape[1:])
        if blocks.dtype != self.layout.dtype or shape != self.layout.block_shape:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {blocks.dtype} {list(shape)} do not match the cache's "
                f"{self.layout.dtype} {list(self.layout.block_shape)}")
        reservation, block_ids = self.table.begin_write(reservation_id, request_id, first_index, blocks.shape[0])
        try:
            self.pool.scatter(block_ids, blocks)
        finally:
            self.table.end_write(reservation)
        return reservation

    async def read(self, reservation_id: str, request_id: str, first_index: int, peer, source_block_ids: list[int],
                   crc: int | None) -> Reservation:
        """Read the sender's blocks ``source_block_ids[j]`` with NIXL into the slot reserved for
        the request's block ``first_index + j``, after the same checks as :meth:`install`. The
        read runs to its end even if the caller is cancelled (the slots stay reserved until it
        has), so await it shielded.

        Args:
            peer: the sender's pool (``NixlAgent.add_peer``).
            crc: the sender's CRC-32 of the blocks (checked when ``verify_checksums``).

        Raises:
            StatusError: as :meth:`install`; ``FAILED_PRECONDITION`` without NIXL here;
                ``UNAVAILABLE`` when the read fails; ``DATA_LOSS`` for a checksum mismatch.
        """
        if self.nixl is None:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "this worker receives KV over gRPC only")
        reservation, block_ids = self.table.begin_write(reservation_id, request_id, first_index,
                                                        len(source_block_ids))
        try:
            await self.nixl.read(peer, source_block_ids, block_ids)
            if self.verify_checksums and crc is not None:
                got = blocks_crc32(self.pool.gather(block_ids))
                if got != crc:
                    raise StatusError(grpc.StatusCode.DATA_LOSS,
                                      f"blocks [{first_index}, {first_index + len(block_ids)}) of reservation "
                                      f"{reservation_id!r}: CRC-32 {got:#010x} != sent {crc:#010x}")
        finally:
            self.table.end_write(reservation)
        return reservation
