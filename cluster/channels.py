"""Client channels to the other servers of the cluster: one ``grpc.aio`` channel per address,
opened on first use and reused, the one place that decides how a Tandem process dials a peer
(message size limits)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc


class ChannelCache:
    """One channel per peer address.

    Args:
        options: channel options for every channel (e.g. ``kvtransfer.GRPC_MESSAGE_OPTIONS``).
    """

    def __init__(self, options: Sequence[tuple[str, int]] = ()) -> None:
        self._options = list(options)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (``host:port``), opened now if there is none."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address, options=self._options)
        return channel

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
