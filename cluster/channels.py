"""Client channels to the other servers of the cluster: one ``grpc.aio`` channel per address,
opened on first use and reused, the one place that decides how a Tandem process dials a peer
(message size limits, TLS credentials and the certificate name a peer must present,
keepalive, reconnect backoff, the trace context of :mod:`cluster.tracing`) and what a server allows its peers.

Keepalive: a peer that is frozen (SIGSTOP, a hung host) keeps its TCP connection open, so
without pings a call to it waits forever. Every connection pings every ``keepalive_time_s``
(also with no call open, and while only receiving); a ping unanswered for
``keepalive_timeout_s`` closes the connection and fails its calls with UNAVAILABLE. Servers
accept pings at that rate (gRPC's default would answer them with GOAWAY ``too_many_pings``).

Reconnect backoff is capped at ``MAX_RECONNECT_BACKOFF_MS``: a channel whose peer was down
retries the connection at least that often, so a restarted peer is reached within about a
second; :meth:`ChannelCache.reset` replaces a channel outright.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence

import grpc

from cluster import tracing
from cluster.tls import ClientCredentials

MAX_RECONNECT_BACKOFF_MS = 1000
# A channel evicted or replaced gets this long for its calls in flight before it is closed, seconds.
RETIRE_GRACE_S = 60.0


def client_keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Channel options of a client: ping every ``time_s`` seconds, fail after ``timeout_s``
    seconds without an ack, reconnect backoff capped at ``MAX_RECONNECT_BACKOFF_MS``."""
    return [*_ping_options(time_s, timeout_s),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", min(MAX_RECONNECT_BACKOFF_MS, 250)),
            ("grpc.min_reconnect_backoff_ms", min(MAX_RECONNECT_BACKOFF_MS, 250)),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def server_keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Server options: ping clients every ``time_s`` seconds (drop one silent for
    ``timeout_s``), and accept their pings as often as every ``time_s / 2`` seconds, calls
    open or not."""
    return [*_ping_options(time_s, timeout_s),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", round(time_s * 500)),
            ("grpc.http2.min_ping_interval_without_data_ms", round(time_s * 500)),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.http2.max_pings_without_data", 0)]


def _ping_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    # gRPC core (seen with grpcio 1.85) times an unanswered ping out by ``ping_timeout_ms``
    # (60 s by default), not by ``keepalive_timeout_ms``: both are set.
    timeout_ms = round(timeout_s * 1000)
    return [("grpc.keepalive_time_ms", round(time_s * 1000)), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.keepalive_permit_without_calls", 1)]


class ChannelCache:
    """One channel per peer address, at most ``max_channels`` (least recently used closed first).

    Args:
        options: channel options for every channel (message sizes, :func:`client_keepalive_options`).
        credentials: TLS credentials, followed as their files change (a change retires every
            channel: the next calls dial with the new ones); ``None``: plaintext.
        peer_name: with TLS, the DNS name the peer's certificate must carry whatever address
            is dialed (e.g. ``tandem-decode``; ``cluster.tls``).
        max_channels: channels kept open at most.
    """

    def __init__(self, options: Sequence[tuple[str, int | str]] = (), credentials: ClientCredentials | None = None,
                 peer_name: str = "", max_channels: int = 64) -> None:
        self._options = list(options)
        if credentials is not None and peer_name:
            self._options.append(("grpc.ssl_target_name_override", peer_name))
        self._credentials = credentials
        self._interceptors = tracing.client_interceptors()  # none while tracing is off
        self._generation = credentials.generation if credentials is not None else 0
        self.max_channels = max_channels
        self._channels: collections.OrderedDict[str, grpc.aio.Channel] = collections.OrderedDict()
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address`` (``host:port``), opened now if there is none."""
        if self._credentials is not None:
            credentials = self._credentials.current()
            if self._credentials.generation != self._generation:  # rotated: retire every channel
                self._generation = self._credentials.generation
                while self._channels:
                    self._retire(self._channels.popitem()[1])
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self._options, interceptors=self._interceptors)
        else:
            channel = grpc.aio.secure_channel(address, credentials, options=self._options,
                                              interceptors=self._interceptors)
        self._channels[address] = channel
        while len(self._channels) > self.max_channels:
            self._retire(self._channels.popitem(last=False)[1])
        return channel

    def state(self, address: str) -> grpc.ChannelConnectivity | None:
        """The connectivity of the channel to ``address`` (``None``: no channel open)."""
        channel = self._channels.get(address)
        return None if channel is None else channel.get_state(try_to_connect=False)

    def reset(self, address: str) -> None:
        """Replace the channel to ``address`` with a fresh one at its next :meth:`get` (a new
        connection attempt at once, none of the old one's reconnect backoff). Calls already on
        the old channel keep running for up to ``RETIRE_GRACE_S`` seconds."""
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._retire(channel)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        async def close_later() -> None:  # Channel.close(grace) would end open streams at once
            await asyncio.sleep(RETIRE_GRACE_S)
            await channel.close()

        task = asyncio.get_running_loop().create_task(close_later())
        self._retiring[task] = channel
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def close(self) -> None:
        """Close every channel, retiring ones included (their calls cancelled)."""
        retiring = dict(self._retiring)
        for task in retiring:  # no more waiting: the close below cancels their calls
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        channels, self._channels = [*self._channels.values(), *retiring.values()], collections.OrderedDict()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
