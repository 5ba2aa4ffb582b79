"""The receive side of every transport: check arriving blocks, write them into their slots, and
verify them there against the sender's digests before they count as arrived."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import torch

from kvtransfer.nixl import NixlAgent
from kvtransfer.pool import KVPool
from kvtransfer.digest import KVIntegrityError, check_digest_count, verify_landed
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

    def install(self, reservation_id: str, request_id: str, first_index: int, blocks: torch.Tensor,
                digests: bytes) -> Reservation:
        """Write ``blocks[j]`` into the slot reserved for the request's block ``first_index + j``,
        then verify the slots against ``digests``.

        Every check (dtype, shape, digest count, reservation, request, range, duplicates, lease)
        passes before a byte is written.

        Args:
            reservation_id: the reservation.
            request_id: the request it must belong to.
            first_index: position of ``blocks[0]`` among the request's blocks.
            blocks: ``[count, *layout.block_shape]`` of ``layout.dtype``, any device.
            digests: the sender's digests of the blocks (:mod:`kvtransfer.digest`'s wire format).

        Returns:
            The reservation, updated (check ``complete``).

        Raises:
            StatusError: ``INVALID_ARGUMENT`` (wrong dtype/shape, digest count, request, range,
                duplicate), ``NOT_FOUND`` (unknown or expired reservation).
            KVIntegrityError: ``ABORTED``, the landed blocks do not match ``digests`` or hold a
                NaN or infinity; they have been zeroed.
        """
        shape = tuple(blocks.shape[1:])
        if blocks.dtype != self.layout.dtype or shape != self.layout.block_shape:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {blocks.dtype} {list(shape)} do not match the cache's "
                f"{self.layout.dtype} {list(self.layout.block_shape)}")
        check_digest_count(digests, blocks.shape[0], self.layout.block_shape[0])
        reservation, block_ids = self.table.begin_write(reservation_id, request_id, first_index, blocks.shape[0])
        try:
            self.pool.scatter(block_ids, blocks)
            self._verify(block_ids, digests, self._where(reservation_id, first_index, block_ids, "grpc"))
        finally:
            self.table.end_write(reservation)
        return reservation

    async def read(self, reservation_id: str, request_id: str, first_index: int, peer, source_block_ids: list[int],
                   digests: bytes, crc: int | None) -> Reservation:
        """Read the sender's blocks ``source_block_ids[j]`` with NIXL into the slot reserved for
        the request's block ``first_index + j``, after the same checks as :meth:`install`, and
        verify them there as it does. The read runs to its end even if the caller is cancelled
        (the slots stay reserved until it has), so await it shielded.

        Args:
            peer: the sender's pool (``NixlAgent.add_peer``).
            digests: the sender's digests of the blocks.
            crc: the sender's CRC-32 of the blocks (checked when ``verify_checksums``).

        Raises:
            StatusError: as :meth:`install`; ``FAILED_PRECONDITION`` without NIXL here;
                ``UNAVAILABLE`` when the read fails; ``DATA_LOSS`` for a checksum mismatch.
            KVIntegrityError: as :meth:`install`.
        """
        if self.nixl is None:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, "this worker receives KV over gRPC only")
        check_digest_count(digests, len(source_block_ids), self.layout.block_shape[0])
        reservation, block_ids = self.table.begin_write(reservation_id, request_id, first_index,
                                                        len(source_block_ids))
        try:
            await self.nixl.read(peer, source_block_ids, block_ids)
            self._verify(block_ids, digests, self._where(reservation_id, first_index, block_ids, "nixl"))
            if self.verify_checksums and crc is not None:
                got = blocks_crc32(self.pool.gather(block_ids))
                if got != crc:
                    raise StatusError(grpc.StatusCode.DATA_LOSS,
                                      f"blocks [{first_index}, {first_index + len(block_ids)}) of reservation "
                                      f"{reservation_id!r}: CRC-32 {got:#010x} != sent {crc:#010x}")
        finally:
            self.table.end_write(reservation)
        return reservation

    def _verify(self, block_ids: list[int], digests: bytes, where: str) -> None:
        """``verify_landed``; blocks that fail it are scrubbed (zeroed) before the error goes on."""
        try:
            verify_landed(self.pool, block_ids, digests, where)
        except KVIntegrityError:
            self.pool.scrub(block_ids)
            raise

    @staticmethod
    def _where(reservation_id: str, first_index: int, block_ids: Sequence[int], transport: str) -> str:
        return (f"blocks [{first_index}, {first_index + len(block_ids)}) of reservation {reservation_id!r} "
                f"(by {transport})")
