"""Receiver-side bookkeeping of KV transfers: which reserved blocks have arrived, and leases.

A decode worker allocates blocks from its own pool, then ``reserve``s them here for one request.
Blocks leave the table in exactly one of two ways: ``claim`` (the transfer is complete and the
request's sequence takes ownership) or release (abort, failed transfer, expired lease), which
hands them back through the ``free_blocks`` callback. So no path leaves a block reserved after
its request has ended (docs/architecture.md, "Leases").

A lease follows progress, not the wall clock alone: while a sender holds a transfer stream
open on the reservation (:meth:`ReservationTable.attach`), the lease is suspended, so a long
prefill that streams its blocks as it computes them never loses its reservation; the stream
itself is the proof of life (a dead or frozen sender ends it, and the receiver releases). The
lease runs only in the gaps: from ``reserve`` to the stream's opening, and from the stream's
end to ``claim``.

The table is not thread-safe: use it from one event loop. A write into reserved blocks is
bracketed by ``begin_write`` (every check, then the positions count as arrived) and
``end_write``; a reservation released while a write is in flight (an Abort during a NIXL read)
leaves the table at once but frees its blocks only when the last write has ended, so the pool
never re-allocates a block that is still being written.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from protos.status import StatusError

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
        deadline: when the lease ends, in the table clock's seconds (ignored while attached).
        lease_s: the lease granted, seconds (each gap gets a whole one).
        num_cached: leading positions filled from the receiver's own prefix cache (arrived from
            the start; the sender skips them).
        attached: a transfer stream is open on the reservation (its lease is suspended).
        arrived: per position, whether that block has been written (or is being written).
        writes: writes in flight (``begin_write`` without its ``end_write``).
        released: the reservation has left the table; its blocks are freed once ``writes`` is 0.
        prompt_key: names the prompt (and cache salt) the blocks were reserved for
            (``engine.block_hash.prompt_key``; empty: unbound); ``claim`` and ``take`` hand the
            blocks only to a caller naming the same one, so the KV received for a prompt enters
            the prefix cache under that prompt's hashes and no other.
    """

    reservation_id: str
    request_id: str
    block_ids: list[int]
    deadline: float
    lease_s: float = DEFAULT_LEASE_S
    num_cached: int = 0
    attached: bool = False
    arrived: list[bool] = field(init=False)
    writes: int = 0
    released: bool = False
    prompt_key: bytes = b""

    def __post_init__(self) -> None:
        self.arrived = [i < self.num_cached for i in range(len(self.block_ids))]

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
        self, request_id: str, block_ids: Sequence[int], lease_s: float | None = None, num_cached: int = 0,
        prompt_key: bytes = b"",
    ) -> Reservation:
        """Record ``block_ids`` (already allocated by the caller) as reserved for ``request_id``.

        From here the table owns the blocks until ``claim`` or a release.

        Args:
            request_id: the request; at most one live reservation each.
            block_ids: physical blocks, one per position of the request's blocks (>= 1, distinct).
            lease_s: lease in seconds; ``None``: the table's default.
            num_cached: leading positions already holding their KV (the receiver's prefix cache).
            prompt_key: binds the reservation to one prompt (see :class:`Reservation`).

        Raises:
            StatusError: ``ALREADY_EXISTS`` if ``request_id`` holds a reservation,
                ``INVALID_ARGUMENT`` for empty or repeated block ids or a lease <= 0.
        """
        if request_id in self._by_request:
            raise StatusError(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} already holds a reservation")
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block_ids must be non-empty and distinct, got {list(block_ids)}")
        lease = self.lease_s if lease_s is None else lease_s
        if lease <= 0:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"lease_s must be > 0, got {lease}")
        reservation = Reservation(secrets.token_hex(16), request_id, list(block_ids), self._clock() + lease,
                                  lease_s=lease, num_cached=num_cached, prompt_key=prompt_key)
        self._by_id[reservation.reservation_id] = reservation
        self._by_request[request_id] = reservation.reservation_id
        return reservation

    def get(self, reservation_id: str) -> Reservation:
        """Return a live reservation; one whose lease has ended is released first.

        Raises:
            StatusError: ``NOT_FOUND``, unknown, released or expired.
        """
        reservation = self._by_id.get(reservation_id)
        if reservation is not None and self._expired(reservation, self._clock()):
            self.release(reservation_id, "lease expired")
            reservation = None
        if reservation is None:
            raise StatusError(
                grpc.StatusCode.NOT_FOUND,
                f"no live reservation {reservation_id!r} (unknown, aborted or expired)")
        return reservation

    def begin_write(
        self, reservation_id: str, request_id: str, first_index: int, count: int
    ) -> tuple[Reservation, list[int]]:
        """Check that blocks ``first_index .. first_index + count - 1`` may be written now, and
        count them as arrived (a second write of one is a duplicate). Call :meth:`end_write`
        when the bytes are in place, whatever happened.

        Returns:
            The reservation and the physical block ids to write, in position order.

        Raises:
            StatusError: ``NOT_FOUND`` (see ``get``); ``INVALID_ARGUMENT`` for another
                request's reservation, positions outside ``[0, num_blocks)``, or a position that
                has already arrived (duplicate).
        """
        reservation = self._get_owned(reservation_id, request_id)
        end = first_index + count
        if count < 1 or first_index < 0 or end > reservation.num_blocks:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks [{first_index}, {end}) outside [0, {reservation.num_blocks}) of "
                f"reservation {reservation_id!r}")
        duplicates = [i for i in range(first_index, end) if reservation.arrived[i]]
        if duplicates:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {duplicates} of reservation {reservation_id!r} already arrived (duplicate)")
        reservation.arrived[first_index:end] = [True] * count
        reservation.writes += 1
        return reservation, reservation.block_ids[first_index:end]

    def end_write(self, reservation: Reservation) -> None:
        """A write begun by :meth:`begin_write` is over (done or failed); frees the blocks of a
        reservation released meanwhile once its last write ends."""
        reservation.writes -= 1
        if reservation.released and reservation.writes == 0:
            self._free_blocks(reservation.block_ids)

    def attach(self, reservation_id: str, request_id: str) -> Reservation:
        """A transfer stream opened on the reservation: suspend its lease until :meth:`detach`.

        Raises:
            StatusError: ``NOT_FOUND`` (see ``get``), ``INVALID_ARGUMENT`` for another request's
                reservation or one that already has a stream.
        """
        reservation = self._get_owned(reservation_id, request_id)
        if reservation.attached:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"reservation {reservation_id!r} already has a transfer stream")
        reservation.attached = True
        return reservation

    def detach(self, reservation_id: str) -> None:
        """The transfer stream ended: the lease runs again, a whole lease from now (for ``claim``)."""
        reservation = self._by_id.get(reservation_id)
        if reservation is not None:
            reservation.attached = False
            reservation.deadline = self._clock() + reservation.lease_s

    def claim(self, reservation_id: str, request_id: str, prompt_key: bytes = b"") -> list[int]:
        """Hand a complete reservation's blocks to the caller (the request's sequence) and forget it.

        Returns:
            Physical block ids in position order; the caller now owns (and must free) them.

        Raises:
            StatusError: ``NOT_FOUND`` (see ``get``), ``INVALID_ARGUMENT`` for another
                request's reservation or another prompt than it was reserved for,
                ``FAILED_PRECONDITION`` if blocks are missing (the reservation stays, under its
                lease).
        """
        reservation = self._get_owned(reservation_id, request_id, prompt_key)
        if not reservation.complete or reservation.writes:
            raise StatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"reservation {reservation_id!r} has {reservation.num_arrived - reservation.writes} of "
                f"{reservation.num_blocks} blocks")
        self._forget(reservation)
        return reservation.block_ids

    def take(self, reservation_id: str, request_id: str, prompt_key: bytes = b"") -> list[int]:
        """Hand a reservation's blocks to the caller whatever arrived (a decode worker that
        prefills the request itself) and forget it.

        Returns:
            Physical block ids in position order; the caller now owns (and must free) them.

        Raises:
            StatusError: ``NOT_FOUND`` (see ``get``), ``INVALID_ARGUMENT`` for another
                request's reservation or another prompt than it was reserved for,
                ``FAILED_PRECONDITION`` while a transfer stream is open on it or a write is in
                flight.
        """
        reservation = self._get_owned(reservation_id, request_id, prompt_key)
        if reservation.attached or reservation.writes:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"reservation {reservation_id!r} is being transferred into")
        self._forget(reservation)
        return reservation.block_ids

    def release(self, reservation_id: str, reason: str) -> bool:
        """Free a reservation's blocks through ``free_blocks`` (once no write is in flight on
        them). Idempotent.

        Returns:
            Whether the reservation was live.
        """
        reservation = self._by_id.get(reservation_id)
        if reservation is None:
            return False
        self._forget(reservation)
        reservation.released = True
        logger.info("released reservation %s of request %s (%d blocks, %d arrived): %s", reservation_id,
                    reservation.request_id, reservation.num_blocks, reservation.num_arrived, reason)
        if not reservation.writes:
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
        expired = [rid for rid, r in self._by_id.items() if self._expired(r, now)]
        for reservation_id in expired:
            self.release(reservation_id, "lease expired")
        return expired

    async def run_expiry(self, interval_s: float = 1.0) -> None:
        """Call ``expire`` every ``interval_s`` seconds until cancelled (run it as a task)."""
        while True:
            self.expire()
            await asyncio.sleep(interval_s)

    @staticmethod
    def _expired(reservation: Reservation, now: float) -> bool:
        return not reservation.attached and now >= reservation.deadline

    def _get_owned(self, reservation_id: str, request_id: str, prompt_key: bytes | None = None) -> Reservation:
        reservation = self.get(reservation_id)
        if request_id != reservation.request_id:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"reservation {reservation_id!r} belongs to request {reservation.request_id!r}, "
                f"not {request_id!r}")
        if prompt_key is not None and prompt_key != reservation.prompt_key:
            raise StatusError.invalid_argument(
                "prompt_token_ids", f"with cache_salt, differ from the prompt reservation {reservation_id!r} "
                                    "was admitted for")
        return reservation

    def _forget(self, reservation: Reservation) -> None:
        del self._by_id[reservation.reservation_id]
        del self._by_request[reservation.request_id]
