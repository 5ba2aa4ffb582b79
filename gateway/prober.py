"""The gateway's health probe of every worker it routes to.

Every ``interval_s`` each worker of the view gets a ``grpc.health.v1.Health/Check`` with a
deadline of ``timeout_s`` on the channel requests use. No SERVING answer in time (dead, frozen
by SIGSTOP or a hung host, draining) marks it down in the view's outlier detector, so routing
stops picking it within ``interval_s + timeout_s``, before its registry entry expires (and
even when its heartbeat lives on while its server does not answer). The first SERVING answer
brings it back.

Channels: a channel in TRANSIENT_FAILURE (its peer refused or dropped the connection) would
wait out its reconnect backoff before trying again, so the probe replaces it
(:meth:`cluster.channels.ChannelCache.reset`); so it does for an address whose worker changed
(a new worker id there) and for a worker whose ejection just ended with its channel not READY.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from cluster.health import SERVING
from cluster.registry import Role, WorkerInfo
from gateway.worker_calls import WorkerClients
from gateway.router import ClusterView
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)


class HealthProber:
    """Probes the view's workers, a round per :meth:`probe_once` (the gateway runs it every
    ``interval_s`` in a :class:`cluster.periodic.PeriodicTask`).

    Args:
        view: the routing state (its workers are probed; verdicts go to ``view.outliers``).
        clients: the gateway's worker clients (their channels, one cache per role).
        interval_s: seconds between rounds.
        timeout_s: seconds one probe waits for its answer.
    """

    def __init__(self, view: ClusterView, clients: WorkerClients, interval_s: float, timeout_s: float) -> None:
        self.view = view
        self.clients = clients
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._known: dict[str, str] = {}  # address -> worker id seen there
        self._ejected: frozenset[str] = frozenset()

    async def probe_once(self) -> None:
        """Probe every worker of the view once, concurrently."""
        workers = [w for role in Role for w in self.view.workers(role)]
        for worker in workers:
            if self._known.get(worker.address, worker.worker_id) != worker.worker_id:
                logger.info("a new worker %s at %s: fresh channel", worker.worker_id, worker.address)
                self.clients.for_role(worker.role).reset(worker.address)
            self._known[worker.address] = worker.worker_id
        _, ejected = self.view.outliers.avoided()
        for worker in workers:
            if worker.worker_id in self._ejected - ejected and not self._ready(worker):
                self.clients.for_role(worker.role).reset(worker.address)
        self._ejected = ejected
        await asyncio.gather(*(self._probe(w) for w in workers))
        self.view.outliers.retain(w.worker_id for w in workers)

    def _ready(self, worker: WorkerInfo) -> bool:
        return self.clients.for_role(worker.role).state(worker.address) == grpc.ChannelConnectivity.READY

    async def _probe(self, worker: WorkerInfo) -> None:
        stub = health_pb2_grpc.HealthStub(self.clients.for_role(worker.role).get(worker.address))
        try:
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
            problem = None if answer.status == SERVING else health_pb2.HealthCheckResponse.ServingStatus.Name(
                answer.status)
        except grpc.aio.AioRpcError as exc:
            problem = f"{exc.code().name} {exc.details()}"
        outliers = self.view.outliers
        if problem is None:
            if outliers.probe_ok(worker.worker_id):
                logger.info("%s worker %s at %s answers SERVING again: routed to", worker.role, worker.worker_id,
                            worker.address)
            return
        if outliers.probe_failed(worker.worker_id):
            logger.warning("%s worker %s at %s failed its health probe (%s): not routed to until it answers",
                           worker.role, worker.worker_id, worker.address, problem)
        if self.clients.for_role(worker.role).state(worker.address) == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self.clients.for_role(worker.role).reset(worker.address)
