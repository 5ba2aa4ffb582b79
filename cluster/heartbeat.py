"""The worker side of the registry: a background heartbeat that keeps a worker's entry and its
prefix-index set alive, and rides out Redis outages (it logs, retries, and resyncs the index
once Redis is back)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from cluster.periodic import PeriodicTask
from cluster.prefix_index import PrefixIndex
from cluster.registry import REDIS_ERRORS, WorkerInfo, WorkerLoad, WorkerRegistry
from engine.core.block_pool import BlockEvents

logger = logging.getLogger(__name__)


class BlockEventSource(Protocol):
    """What :class:`Heartbeat` reads from a worker's prefix cache (``engine.core.block_pool.BlockPool``)."""

    def drain_events(self) -> BlockEvents: ...

    def cached_hashes(self) -> Iterable[bytes]: ...


class Heartbeat:
    """Background task that keeps one worker registered and its prefix-index entries fresh.

    Every ``interval_s`` seconds: heartbeat with the current load, then publish the block
    stored/removed events drained from ``blocks`` (if given). The whole cached set is
    published instead (a resync) on the first beat, after any failed publish, and whenever
    Redis lost the worker's keys (TTL ran out during an outage, or Redis restarted empty).
    Redis errors are logged and retried on the next beat; they never escape the task.
    ``load``, ``blocks.drain_events`` and ``blocks.cached_hashes`` are called on the event
    loop's thread and must not block.

    Args:
        registry: the namespace's registry.
        worker: this worker's identity (its ``load`` field is ignored; ``load()`` is used).
        load: returns the current load.
        index: the prefix index; required with ``blocks``.
        blocks: the worker's prefix cache (prefill workers); ``None`` publishes no blocks.
        interval_s: seconds between beats; must be below ``registry.ns.ttl_s``.

    Raises:
        ValueError: ``interval_s`` not in ``(0, ttl_s)``, or only one of ``index``/``blocks``.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        worker: WorkerInfo,
        load: Callable[[], WorkerLoad],
        *,
        index: PrefixIndex | None = None,
        blocks: BlockEventSource | None = None,
        interval_s: float,
    ) -> None:
        if not 0 < interval_s < registry.ns.ttl_s:
            raise ValueError(f"interval_s must be in (0, ttl_s={registry.ns.ttl_s}), got {interval_s}")
        if (index is None) != (blocks is None):
            raise ValueError("index and blocks must be given together")
        self.registry = registry
        self.worker = worker
        self.interval_s = interval_s
        self._load = load
        self._index = index
        self._blocks = blocks
        self._index_synced = False
        self._failing = False
        self._loop = PeriodicTask(self._beat_logged, interval_s, f"heartbeat-{worker.worker_id}")

    def start(self) -> None:
        """Start beating in the background (call from the running event loop).

        Raises:
            RuntimeError: already started.
        """
        self._loop.start()

    async def stop(self) -> None:
        """Stop beating, then deregister (best effort: if Redis is down the entries expire).
        No beat follows the deregistration (:class:`cluster.periodic.PeriodicTask`)."""
        if not self._loop.running:
            return
        await self._loop.stop()
        try:
            await self.registry.deregister(self.worker.worker_id, self.worker.role)
            if self._index is not None:
                await self._index.drop(self.worker.worker_id)
        except REDIS_ERRORS as exc:
            logger.warning("deregistering %s failed (%s); its keys expire in %.1f s",
                           self.worker.worker_id, exc, self.registry.ns.ttl_s)

    async def beat(self) -> None:
        """Send one heartbeat and the prefix-cache changes since the last one.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable (the next beat catches up).
        """
        current = dataclasses.replace(self.worker, load=self._load())
        created = await self.registry.heartbeat(current)
        if self._index is None or self._blocks is None:
            return
        if created or not self._index_synced:
            self._blocks.drain_events()  # the snapshot below already reflects them
            hashes = self._blocks.cached_hashes()
            self._index_synced = False
            await self._index.resync(self.worker.worker_id, hashes)
        else:
            events = self._blocks.drain_events()
            self._index_synced = False  # if this publish fails, its events are lost: resync next beat
            await self._index.publish(self.worker.worker_id, events.stored, events.removed)
        self._index_synced = True

    async def _beat_logged(self) -> None:
        """One beat; a Redis error is logged once per outage and retried by the next beat."""
        try:
            await self.beat()
        except REDIS_ERRORS as exc:
            if not self._failing:
                logger.warning("heartbeat of %s failed (%s); retrying every %.1f s",
                               self.worker.worker_id, exc, self.interval_s)
            self._failing = True
            return
        if self._failing:
            logger.info("heartbeat of %s reaches Redis again", self.worker.worker_id)
        self._failing = False
