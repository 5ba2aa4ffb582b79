"""What every Tandem server serves besides its own API, and how it binds.

:class:`ServerScaffold` builds the ``grpc.aio`` server with health checking (``Check``, ``List``
and a ``Watch`` that ends on shutdown, :mod:`cluster.health`), reflection v1/v1alpha of the
services it lists where enabled (:mod:`cluster.reflection`), and ``INVALID_ARGUMENT`` for a
request that does not parse (:mod:`cluster.interceptors`); where asked, a plaintext port of
health ``Check`` alone for probes that speak no TLS (:meth:`ServerScaffold.serve_probes`). A
listen address or metrics port that cannot be bound raises :class:`BindError`, one line naming
the address and the setting; the entry points print it and exit 1. This module loads no torch:
the gateway process uses it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from cluster import tracing
from cluster.health import HealthServicer, ProbeHealthServicer
from cluster.interceptors import MalformedRequestInterceptor
from cluster.reflection import add_reflection
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc
from protos.status import StatusError

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class StartupError(RuntimeError):
    """A server cannot start as configured (the message says which setting)."""


class BindError(OSError):
    """An address could not be bound; the message names it and the setting that chose it."""


class Admission:
    """Whether a server takes new work, and how much is in flight (for the drain).

    Servicers wrap each unit of work in :meth:`track` and call :meth:`check` where new work
    enters (``Generate``, ``Prefill``, ``Admit``).
    """

    def __init__(self) -> None:
        self.open = True
        self.in_flight = 0
        self._changed = asyncio.Event()

    def check(self) -> None:
        """Refuse new work once the server is draining.

        Raises:
            StatusError: ``UNAVAILABLE``.
        """
        if not self.open:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._changed.set()

    async def wait_idle(self, timeout_s: float, extra: Callable[[], int] = lambda: 0) -> bool:
        """Wait until nothing is in flight (``in_flight + extra() == 0``); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight + extra() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                # Re-check at least every 0.1 s: ``extra`` (e.g. live reservations) has no event.
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
        return True


class ServerScaffold:
    """A ``grpc.aio`` server with health and reflection, before its own servicers are added.

    Args:
        services: full names of the server's own services (health reports each; reflection
            lists them).
        options: ``grpc.aio.server`` channel options (message size limits, ...).
        reflection: serve gRPC reflection (off: a caller cannot list the services).
        interceptors: run after :class:`~cluster.interceptors.MalformedRequestInterceptor`
            (which every server has), in order.
        new_traces: with tracing on (:mod:`cluster.tracing`, outermost), start a trace for a call
            of ``services`` that carries none (the public endpoint); otherwise only calls that
            arrive with a trace context are traced.

    Attributes:
        server: add the servicers to it, then :meth:`bind` and :meth:`start`.
        health: NOT_SERVING for everything until the owner says otherwise.
    """

    def __init__(self, services: Sequence[str], options: Sequence[tuple[str, int]] = (), *, reflection: bool,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (), new_traces: bool = False) -> None:
        # No SO_REUSEPORT: a second server on a taken port must fail, not share it silently.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options],
                                      interceptors=[*tracing.server_interceptors(services, new_traces),
                                                    MalformedRequestInterceptor(), *interceptors])
        self.health = HealthServicer(list(services))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection:
            add_reflection(self.server, [*services, HEALTH_SERVICE])
        self._probes: grpc.aio.Server | None = None

    def bind(self, address: str, setting: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Listen on ``address`` (``host:port``; port 0 picks a free one) and return the port;
        with ``credentials`` (``cluster.tls``) the port speaks TLS only.

        Raises:
            BindError: the address is taken or invalid; names ``address`` and ``setting``.
        """
        return _add_port(self.server, address, setting, credentials)

    def serve_probes(self, host: str, port: int, setting: str) -> int:
        """Also serve health ``Check`` in plaintext on ``host:port`` (port 0: any free one), for
        probes that cannot speak TLS, such as Kubernetes' ``grpc`` probes
        (:class:`~cluster.health.ProbeHealthServicer`: the statuses of :attr:`health`, plus
        ``liveness``); returns the bound port. Started and stopped with the server.

        Raises:
            BindError: the address is taken or invalid; names it and ``setting``.
        """
        self._probes = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 4)],
                                       interceptors=[MalformedRequestInterceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(ProbeHealthServicer(self.health), self._probes)
        return _add_port(self._probes, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", setting)

    async def start(self) -> None:
        await self.server.start()
        if self._probes is not None:
            await self._probes.start()

    async def stop(self, grace_s: float) -> None:
        """End every health Watch stream (NOT_SERVING first), then stop the server, giving
        in-flight calls ``grace_s`` seconds (the probe port, none)."""
        await self.health.shutdown()
        if self._probes is not None:
            await self._probes.stop(0)
        await self.server.stop(grace_s)


def _add_port(server: grpc.aio.Server, address: str, setting: str,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a listening port to ``server`` (TLS with ``credentials``) and return its number.

    Raises:
        BindError: the address is taken or invalid; names ``address`` and ``setting``.
    """
    _check_free(address, setting)
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as exc:  # grpcio reports a failed bind this way
        raise BindError(f"cannot listen on {address} ({setting}): {exc}") from None
    if not port:
        raise BindError(f"cannot listen on {address} ({setting})")
    return port


def _check_free(address: str, setting: str) -> None:
    """Bind ``address`` once with a plain socket, so that a taken or invalid address is reported
    in one line (gRPC's core would log a multi-line error of its own first).

    Raises:
        BindError: naming ``address`` and ``setting``.
    """
    host, _, port = address.rpartition(":")
    if port == "0":
        return
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BindError(f"cannot listen on {address} ({setting}): {reason}") from None


def serve_metrics(registry: CollectorRegistry, host: str, port: int, setting: str):
    """Serve ``registry`` at ``http://host:port/metrics`` (on the server's listen host, never all
    interfaces unless that is the listen host); returns the HTTP server (``shutdown()`` stops it).

    Raises:
        BindError: the port is taken; names ``host:port`` and ``setting``.
    """
    try:
        server, _ = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
    except OSError as exc:
        raise BindError(f"cannot serve metrics on {host}:{port} ({setting}): {exc.strerror or exc}") from None
    return server
