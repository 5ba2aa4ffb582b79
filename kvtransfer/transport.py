"""What a KV transport is: the sender's interface and where it sends to.

A transport moves a request's blocks from the prefill worker's cache into a decode worker's
reservation. The receive side is shared by all transports: they hand verified blocks to
``KVReceiver.install``, which checks them against the ``ReservationTable`` and writes them.
``KVTransferClient`` opens the ``TransferKV`` stream either way: it carries the blocks' bytes (gRPC)
or the sender's block ids for the receiver to read with NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtransfer.pool import KVPool


@dataclass(frozen=True)
class KVDestination:
    """A decode worker's reservation.

    Attributes:
        address: the decode worker's gRPC address, ``"host:port"``.
        reservation_id: from that worker's ``Admit``.
        num_cached_blocks: leading positions the decode worker already holds (not sent).
        kv_transports: the transports the decode worker takes (``"nixl"``, ``"grpc"``).
    """

    address: str
    reservation_id: str
    num_cached_blocks: int = 0
    kv_transports: tuple[str, ...] = ("grpc",)


class KVTransfer(Protocol):
    """One request's transfer into one reservation, as an async context manager: entering it
    opens the stream (and keeps the reservation alive), leaving it without :meth:`finish`
    cancels the transfer (the receiver then frees the reservation)."""

    num_sent: int  # blocks sent so far
    transport: str  # "nixl" or "grpc"

    async def __aenter__(self) -> KVTransfer: ...

    async def __aexit__(self, *exc) -> None: ...

    async def send(self, pool: KVPool, first_index: int, block_ids: Sequence[int]) -> None:
        """Send ``pool``'s blocks ``block_ids[i]`` as the request's block ``first_index + i``.

        Args:
            pool: the sender's KV pool (every tensor-parallel rank's part); the blocks must stay
                unchanged (pinned) until this returns.
            first_index: position of ``block_ids[0]`` among the request's blocks.
            block_ids: the sender's physical blocks, in position order.

        Raises:
            StatusError: the receiver refused the blocks or the peer failed; ``code`` says which.
        """
        ...

    async def finish(self) -> int:
        """Every block is sent: wait for the receiver's acknowledgement; returns the blocks it
        acknowledged (all of the reservation's).

        Raises:
            StatusError: the receiver refused the transfer (blocks missing, bad data) or the peer
                failed or the deadline passed; the receiver has freed the reservation.
        """
        ...


class KVSender(Protocol):
    """Opens transfers of KV blocks into reservations on other workers."""

    def open(self, destination: KVDestination, request_id: str, timeout_s: float | None = None) -> KVTransfer:
        """A transfer of ``request_id``'s blocks into ``destination`` (enter it with ``async with``);
        ``timeout_s`` bounds the whole transfer (``None``: the caller's cancellation does)."""
        ...

