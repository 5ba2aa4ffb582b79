"""What a KV transport is: the sender's interface and where it sends to.

A transport moves a request's blocks from the prefill worker's cache into a decode worker's
reservation. The receive side is shared by all transports: they hand verified blocks to
``KVReceiver.install``, which checks them against the ``ReservationTable`` and writes them.
``GrpcKVSender`` (any host) is the one implementation today; a same-host one (CUDA IPC / NVLink)
would implement ``KVSender`` too, e.g. by exporting the source blocks' IPC handles so that the
decode worker copies them device-to-device and calls ``install`` with a view of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVDestination:
    """A decode worker's reservation.

    Attributes:
        address: the decode worker's gRPC address, ``"host:port"``.
        reservation_id: from that worker's ``Admit``.
    """

    address: str
    reservation_id: str


class KVSender(Protocol):
    """Pushes one request's KV blocks into a reservation on another worker."""

    async def send(
        self, kv_cache: torch.Tensor, block_ids: Sequence[int], destination: KVDestination, request_id: str
    ) -> int:
        """Send ``kv_cache[block_ids[i]]`` as the request's block ``i``, for every ``i``.

        Args:
            kv_cache: the sender's cache, ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
                head_dim]``; the blocks must stay unchanged (pinned) until this returns.
            block_ids: the request's physical blocks on the sender, in position order; as many
                as the reservation holds.
            destination: where to.
            request_id: the request (checked against the reservation).

        Returns:
            Blocks the receiver acknowledged (all of them).

        Raises:
            KVTransferError: the receiver refused the blocks, the peer failed or the deadline
                passed; ``code`` says which. The receiver has freed the reservation.
        """
        ...

    async def close(self) -> None:
        """Release the transport's connections."""
        ...
