"""Client channels to the other servers of the cluster: one ``grpc.aio`` channel per address,
opened on first use and reused, the one place that decides how a Tandem process dials a peer
(message size limits, TLS credentials and the certificate name a peer must present)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

import grpc

# Evicted channels get this long for their calls in flight before they are closed, seconds.
EVICTION_GRACE_S = 60.0


class ChannelCache:
    """One channel per peer address, at most ``max_channels`` (least recently used closed first).

    Args:
        options: channel options for every channel (e.g. ``kvtransfer.GRPC_MESSAGE_OPTIONS``).
        credentials: TLS credentials (``cluster.tls.TlsFiles.channel_credentials``); ``None``:
            plaintext.
        peer_name: with TLS, the DNS name the peer's certificate must carry whatever address
            is dialed (e.g. ``tandem-decode``; ``cluster.tls``).
        max_channels: channels kept open at most.
    """

    def __init__(self, options: Sequence[tuple[str, int | str]] = (), credentials: grpc.ChannelCredentials | None = None,
                 peer_name: str = "", max_channels: int = 64) -> None:
        self._options = list(options)
        if credentials is not None and peer_name:
            self._options.append(("grpc.ssl_target_name_override", peer_name))
        self._credentials = credentials
        self.max_channels = max_channels
        self._channels: collections.OrderedDict[str, grpc.aio.Channel] = collections.OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (``host:port``), opened now if there is none."""
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
        self._channels[address] = channel
        while len(self._channels) > self.max_channels:
            _, oldest = self._channels.popitem(last=False)
            task = asyncio.get_running_loop().create_task(oldest.close(EVICTION_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    async def close(self) -> None:
        """Close every channel."""
        channels, self._channels = list(self._channels.values()), collections.OrderedDict()
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)
