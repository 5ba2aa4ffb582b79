"""The prefill worker's gRPC servicer: the prefill service (:mod:`cluster.prefill_service`) over
the worker's own KV pool, KV transports and NIXL agent."""

from __future__ import annotations

from cluster.metrics import WorkerMetrics
from cluster.prefill_service import PrefillService
from cluster.registry import Role
from cluster.server import Admission
from cluster.settings import WorkerSettings
from cluster.worker import kv_transport, published_config
from engine.core.core_client import EngineCoreClient
from kvtransfer import KVPool, KVSender


class PrefillServicer(PrefillService):
    """Serves ``tandem.v1.PrefillWorker`` (:class:`cluster.prefill_service.PrefillService`) as the
    worker's only service.

    Args:
        engine: the worker's running engine.
        settings: as :class:`~cluster.prefill_service.PrefillService`, and the KV transport settings.
        metrics: the worker's metrics.
        sender: the KV transport (default: NIXL or gRPC per ``kv_transport``, over the worker's
            channels to decode workers).

    Raises:
        cluster.server.StartupError: ``kv_transport`` is ``nixl`` and NIXL cannot start.
    """

    def __init__(self, engine: EngineCoreClient, settings: WorkerSettings, metrics: WorkerMetrics,
                 sender: KVSender | None = None) -> None:
        pool = KVPool(engine.kv_pools)
        transports, self.nixl = kv_transport(settings, settings.resolved_worker_id(str(Role.PREFILL)), pool)
        super().__init__(engine, settings, metrics, Role.PREFILL, pool, transports, self.nixl,
                         published_config(engine.info, engine.kv_pools, transports), Admission(), sender)

    def pending(self) -> int:
        return 0

    async def close(self) -> None:
        await super().close()
        if self.nixl is not None:
            self.nixl.close()
