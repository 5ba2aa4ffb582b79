"""``grpc.health.v1.Health`` for every Tandem server: ``Check``, ``List`` and ``Watch``.

Written here rather than taken from grpcio-health-checking because that package serves
neither ``List`` nor a ``Watch`` that ends: its watch streams outlive a graceful shutdown, so
a client watching a draining server held the drain for its whole timeout. :meth:`shutdown`
reports NOT_SERVING to every watcher and then ends their streams.

:class:`ProbeHealthServicer` answers ``Check`` alone on a plaintext port of its own, for
probes that cannot speak TLS (Kubernetes' ``grpc`` probes), with one more name, ``liveness``.
"""

from __future__ import annotations

import asyncio

import grpc

from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
# The probe port's extra name: SERVING while the process answers, until its shutdown.
LIVENESS = "liveness"


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Statuses of a server (``""``) and its services, for health probes and load balancers.

    Args:
        services: names known from the start, all NOT_SERVING until :meth:`set` says otherwise.
    """

    def __init__(self, services: list[str]) -> None:
        self._status: dict[str, int] = dict.fromkeys(["", *services], NOT_SERVING)
        self._changed = asyncio.Condition()
        self._shut_down = False

    async def set(self, service: str, status: int) -> None:
        """Set one service's status and tell its watchers (ignored once shut down)."""
        if self._shut_down:
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def set_all(self, status: int) -> None:
        """Set the server's and every service's status."""
        for service in list(self._status):
            await self.set(service, status)

    async def shutdown(self) -> None:
        """Report NOT_SERVING for everything, for good, and end every Watch stream."""
        async with self._changed:
            self._status = dict.fromkeys(self._status, NOT_SERVING)
            self._shut_down = True
            self._changed.notify_all()

    @property
    def shut_down(self) -> bool:
        """Whether :meth:`shutdown` has run (everything NOT_SERVING for good)."""
        return self._shut_down

    def status(self, service: str = "") -> int:
        """The current status of ``service`` (``SERVICE_UNKNOWN`` if it is not known)."""
        return self._status.get(service, SERVICE_UNKNOWN)

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if request.service not in self._status:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self._status[request.service])

    async def List(self, request: health_pb2.HealthListRequest, context):  # noqa: N802
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self._status.items()})

    async def Watch(self, request: health_pb2.HealthCheckRequest, context):  # noqa: N802
        last = None
        while True:
            async with self._changed:
                status, done = self.status(request.service), self._shut_down
                if status == last and not done:
                    await self._changed.wait()
                    continue
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if done:
                return


class ProbeHealthServicer(health_pb2_grpc.HealthServicer):
    """``Check`` for probes on a plaintext port (``health_port``): every name ``health`` knows,
    with its status, and :data:`LIVENESS`, SERVING from start until ``health`` shuts down.

    Liveness is its own name because ``""`` means "can serve a request": the gateway reports it
    NOT_SERVING while no decode worker is routable, and a liveness probe on it would restart a
    healthy gateway whenever its pool is down or still loading. ``List`` and ``Watch`` are not
    served here (UNIMPLEMENTED): a probe needs neither, and a port open to every pod should hold
    no streams.

    Args:
        health: the server's servicer (its TLS port serves it whole).
    """

    def __init__(self, health: HealthServicer) -> None:
        self._health = health

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if request.service == LIVENESS:
            return health_pb2.HealthCheckResponse(status=NOT_SERVING if self._health.shut_down else SERVING)
        return await self._health.Check(request, context)

    async def List(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the probe port serves Check only")

    async def Watch(self, request, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the probe port serves Check only")
