"""Receiver-side bookkeeping of KV transfers: which reserved blocks have arrived, and leases.

A decode worker allocates blocks from its own pool, then ``reserve``s them here for one request.
Blocks leave the table in exactly one of two ways: ``claim`` (the transfer is complete and the
request's sequence takes ownership) or release (abort, failed transfer, expired lease), which
hands them back through the ``free_blocks`` callback. So no path leaves a block reserved after
its request has ended (DESIGN.md, "Leases").

The table is not thread-safe: use it from one event loop. Check-then-write sequences
(``check_arrival``, copy, ``mark_arrived``) must not ``await`` in between, so that an expiry
cannot free (and the pool re-allocate) a block between its check and its write.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvtransfer.errors import KVTransferError

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0


@dataclass
class Reservation:
    """Blocks reserved on this worker for one request's incoming KV.

    Attributes:
        reservation_id: unguessable id (32 hex chars) the sender quotes in every chunk.
        request_id: the request the blocks are for.
        block_ids: physical block receiving the request's block at each position
            ``0 .. num_blocks - 1``.
        deadline: when the lease ends, in the table clock's seconds.
        arrived: per position, whether that block has been written.
    """

    reservation_id: str
    request_id: str
    block_ids: list[int]
    deadline: float
    arrived: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = [False] * len(self.block_ids)

    @property
    def num_blocks(self) -> int:
        """Blocks reserved."""
        return len(self.block_ids)

    @property
    def num_arrived(self) -> int:
        """Blocks written so far."""
        return sum(self.arrived)

    @property
    def complete(self) -> bool:
        """Every block has arrived."""
        return all(self.arrived)


class ReservationTable:
    """Reservations of one decode worker, keyed by reservation id (and findable by request id).

    Args:
        free_blocks: gives physical block ids back to the worker's pool (e.g.
            ``BlockPool.free``); called once per released reservation with all its blocks.
        lease_s: default lease, seconds (> 0).
        clock: monotonic time source in seconds (tests pass a fake one).

    Raises:
        ValueError: ``lease_s <= 0``.
    """

    def __init__(
        self, free_blocks: Callable[[list[int]], None], *, lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._free_blocks = free_blocks
        self.lease_s = lease_s
        self._clock = clock
        self._by_id: dict[str, Reservation] = {}
        self._by_request: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held by live reservations."""
        return sum(r.num_blocks for r in self._by_id.values())

    def reserve(
        self, request_id: str, block_ids: Sequence[int], lease_s: float | None = None
    ) -> Reservation:
        """Record ``block_ids`` (already allocated by the caller) as reserved for ``request_id``.

        From here the table owns the blocks until ``claim`` or a release.

        Args:
            request_id: the request; at most one live reservation each.
            block_ids: physical blocks, one per position of the request's blocks (>= 1, distinct).
            lease_s: lease in seconds; ``None``: the table's default.

        Raises:
            KVTransferError: ``ALREADY_EXISTS`` if ``request_id`` holds a reservation,
                ``INVALID_ARGUMENT`` for empty or repeated block ids or a lease <= 0.
        """
        if request_id in self._by_request:
            raise KVTransferError(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} already holds a reservation")
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise KVTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_ids must be non-empty and distinct, got {list(block_ids)}")
        lease = self.lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise KVTransferError(grpc.StatusCode.INVALID_ARGUMENT, f"lease_s must be > 0, got {lease}")
        reservation = Reservation(
            secrets.token_hex(16), request_id, list(block_ids), self._clock() + lease)
        self._by_id[reservation.reservation_id] = reservation
        self._by_request[request_id] = reservation.reservation_id
        return reservation

    def get(self, reservation_id: str) -> Reservation:
        """Return a live reservation; one whose lease has ended is released first.

        Raises:
            KVTransferError: ``NOT_FOUND``, unknown, released or expired.
        """
        reservation = self._by_id.get(reservation_id)
        if reservation is not None and self._clock() >= reservation.deadline:
            self.release(reservation_id, "lease expired")
            reservation = None
        if reservation is None:
            raise KVTransferError(
                grpc.StatusCode.NOT_FOUND,
                f"no live reservation {reservation_id!r} (unknown, aborted or expired)")
        return reservation

    def check_arrival(
        self, reservation_id: str, request_id: str, first_index: int, count: int
    ) -> list[int]:
        """Validate that blocks ``first_index .. first_index + count - 1`` may be written now.

        Returns:
            Their physical block ids, in position order.

        Raises:
            KVTransferError: ``NOT_FOUND`` (see ``get``); ``INVALID_ARGUMENT`` for another
                request's reservation, positions outside ``[0, num_blocks)``, or a position that
                has already arrived (duplicate).
        """
        reservation = self._get_owned(reservation_id, request_id)
        end = first_index + count
        if count < 1 or first_index < 0 or end > reservation.num_blocks:
            raise KVTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks [{first_index}, {end}) outside [0, {reservation.num_blocks}) of "
                f"reservation {reservation_id!r}")
        duplicates = [i for i in range(first_index, end) if reservation.arrived[i]]
        if duplicates:
            raise KVTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {duplicates} of reservation {reservation_id!r} already arrived (duplicate)")
        return reservation.block_ids[first_index:end]

    def mark_arrived(self, reservation_id: str, first_index: int, count: int) -> Reservation:
        """Record blocks ``first_index .. + count - 1`` as written (after ``check_arrival`` passed).

        Raises:
            KVTransferError: ``NOT_FOUND`` (see ``get``).
        """
        reservation = self.get(reservation_id)
        reservation.arrived[first_index : first_index + count] = [True] * count
        return reservation

    def claim(self, reservation_id: str, request_id: str) -> list[int]:
        """Hand a complete reservation's blocks to the caller (the request's sequence) and forget it.

        Returns:
            Physical block ids in position order; the caller now owns (and must free) them.

        Raises:
            KVTransferError: ``NOT_FOUND`` (see ``get``), ``INVALID_ARGUMENT`` for another
                request's reservation, ``FAILED_PRECONDITION`` if blocks are missing (the
                reservation stays, under its lease).
        """
        reservation = self._get_owned(reservation_id, request_id)
        if not reservation.complete:
            raise KVTransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reservation {reservation_id!r} has {reservation.num_arrived} of "
                f"{reservation.num_blocks} blocks")
        self._forget(reservation)
        return reservation.block_ids

    def release(self, reservation_id: str, reason: str) -> bool:
        """Free a reservation's blocks through ``free_blocks``. Idempotent.

        Returns:
            Whether the reservation was live.
        """
        reservation = self._by_id.get(reservation_id)
        if reservation is None:
            return False
        self._forget(reservation)
        logger.info("released reservation %s of request %s (%d blocks, %d arrived): %s", reservation_id,
                    reservation.request_id, reservation.num_blocks, reservation.num_arrived, reason)
        self._free_blocks(reservation.block_ids)
        return True

    def release_request(self, request_id: str, reason: str) -> bool:
        """``release`` the reservation of ``request_id``, if any (the Abort path)."""
        reservation_id = self._by_request.get(request_id)
        return reservation_id is not None and self.release(reservation_id, reason)

    def release_all(self, reason: str) -> int:
        """``release`` every live reservation (a worker shutting down); return how many."""
        reservation_ids = list(self._by_id)
        for reservation_id in reservation_ids:
            self.release(reservation_id, reason)
        return len(reservation_ids)

    def expire(self) -> list[str]:
        """Release every reservation whose lease has ended; return their ids."""
        now = self._clock()
        expired = [rid for rid, r in self._by_id.items() if now >= r.deadline]
        for reservation_id in expired:
            self.release(reservation_id, "lease expired")
        return expired

    async def run_expiry(self, interval_s: float = 1.0) -> None:
        """Call ``expire`` every ``interval_s`` seconds until cancelled (run it as a task)."""
        while True:
            self.expire()
            await asyncio.sleep(interval_s)

    def _get_owned(self, reservation_id: str, request_id: str) -> Reservation:
        reservation = self.get(reservation_id)
        if request_id != reservation.request_id:
            raise KVTransferError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reservation {reservation_id!r} belongs to request {reservation.request_id!r}, "
                f"not {request_id!r}")
        return reservation

    def _forget(self, reservation: Reservation) -> None:
        del self._by_id[reservation.reservation_id]
        del self._by_request[reservation.request_id]
