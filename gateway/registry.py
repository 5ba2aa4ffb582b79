"""Worker registry in Redis: who is alive, where, and how loaded.

Each worker keeps a hash ``{ns}:worker:{id}`` (role, address, load) alive with a heartbeat
every ``interval_s``; the hash carries a TTL of ``ns.ttl_s``, so a worker that stops beating
disappears on its own. A per-role set ``{ns}:workers:{role}`` lists the ids; the gateway
reads a role's live workers in one round trip with a Lua script that also prunes ids whose
hash has expired. Liveness is decided by Redis' own key expiry, never by comparing clocks of
different hosts. ``{ns}`` is ``tandem:{key_prefix}:{model_id}:{block_size}``.

:class:`Heartbeat` is the worker side: a background task that beats, publishes the worker's
prefix-cache events to the :class:`~gateway.prefix_index.PrefixIndex`, and rides out Redis
outages (it logs, retries, and resyncs the index once Redis is back).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from engine.block_pool import BlockEvents
    from gateway.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

# Everything a lost or slow Redis raises (redis-py wraps socket errors; TimeoutError is an OSError).
REDIS_ERRORS = (RedisError, OSError)

_WORKER_ID = re.compile(r"[A-Za-z0-9._-]+")

# KEYS[1]: the role's id set. ARGV[1]: the worker-hash key prefix ("{ns}:worker:").
# Returns one flat [field, value, ...] array per live worker; drops ids whose hash expired.
_LIVE_WORKERS_LUA = """
local live = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local fields = redis.call('HGETALL', ARGV[1] .. id)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)
  else
    live[#live + 1] = fields
  end
end
return live
"""


class Role(enum.StrEnum):
    """A worker pool: prefill workers compute prompts, decode workers generate tokens."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ClusterNamespace:
    """Where the cluster state lives in Redis and how long a worker's entries outlive it.

    Args:
        key_prefix: deployment (or test) name; keys start with ``tandem:{key_prefix}:``.
        model_id: the served model's id.
        block_size: tokens per KV block (block hashes differ per block size).
        ttl_s: seconds a worker's entries live after its last heartbeat (> its interval).

    Raises:
        ValueError: an empty ``key_prefix``/``model_id``, ``block_size < 1`` or ``ttl_s <= 0``.
    """

    key_prefix: str
    model_id: str
    block_size: int
    ttl_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.key_prefix:
            raise ValueError("key_prefix must not be empty")
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")

    @property
    def root(self) -> str:
        return f"tandem:{self.key_prefix}:{self.model_id}:{self.block_size}"

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    def role_key(self, role: Role) -> str:
        return f"{self.root}:workers:{role}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.root}:worker:{worker_id}"

    def blocks_key(self, worker_id: str) -> str:
        return f"{self.worker_key(worker_id)}:blocks"


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load at its last heartbeat (counts of sequences and KV blocks)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0

    @property
    def num_seqs(self) -> int:
        """Sequences running or queued on the worker."""
        return self.running + self.waiting


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker: identity, gRPC address (``host:port``) and load.

    Raises:
        ValueError: ``worker_id`` is empty or has characters outside ``[A-Za-z0-9._-]``.
    """

    worker_id: str
    role: Role
    address: str
    load: WorkerLoad = WorkerLoad()

    def __post_init__(self) -> None:
        if not _WORKER_ID.fullmatch(self.worker_id):
            raise ValueError(f"worker_id must match [A-Za-z0-9._-]+, got {self.worker_id!r}")

    def to_fields(self) -> dict[str, str | int]:
        return {
            "worker_id": self.worker_id,
            "role": self.role.value,
            "address": self.address,
            "running": self.load.running,
            "waiting": self.load.waiting,
            "free_blocks": self.load.free_blocks,
            "total_blocks": self.load.total_blocks,
        }

    @classmethod
    def from_fields(cls, flat: list[bytes]) -> WorkerInfo:
        """Parse HGETALL's flat ``[field, value, ...]`` reply."""
        f = {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2])}
        load = WorkerLoad(int(f["running"]), int(f["waiting"]), int(f["free_blocks"]), int(f["total_blocks"]))
        return cls(f["worker_id"], Role(f["role"]), f["address"], load)


def redis_client(url: str, timeout_s: float = 0.5, retries: int = 1) -> redis.Redis:
    """Return a ``redis.asyncio`` client suited to routing: bytes replies, short timeouts.

    redis-py's defaults (5 s timeouts, 10 retries) would stall every heartbeat and refresh for
    many seconds while Redis is down; here a lost Redis fails within about
    ``(retries + 1) * timeout_s`` seconds and the callers fall back to last-known state.

    Args:
        url: e.g. ``redis://127.0.0.1:6379/0``.
        timeout_s: connect and socket timeout in seconds.
        retries: extra attempts on connection errors.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=timeout_s, base=0.01), retries),
    )


class WorkerRegistry:
    """Registration, heartbeats and the live-worker listing of one namespace."""

    def __init__(self, client: redis.Redis, ns: ClusterNamespace) -> None:
        self.client = client
        self.ns = ns
        self._live_workers = client.register_script(_LIVE_WORKERS_LUA)

    async def heartbeat(self, worker: WorkerInfo) -> bool:
        """Write the worker's info and load and push its expiry ``ns.ttl_s`` seconds out.

        Returns:
            True if the registration was (re)created: first beat, or Redis lost the key (it
            expired, or Redis restarted). The worker must then resync its prefix index.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        key, role_key = self.ns.worker_key(worker.worker_id), self.ns.role_key(worker.role)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=worker.to_fields())
            pipe.pexpire(key, self.ns.ttl_ms)
            pipe.sadd(role_key, worker.worker_id)
            # The set outlives its last member by one TTL; ids of dead members are pruned on read.
            pipe.pexpire(role_key, self.ns.ttl_ms)
            new_fields, *_ = await pipe.execute()
        return new_fields > 0

    async def deregister(self, worker_id: str, role: Role) -> None:
        """Remove the worker now (a clean shutdown) instead of waiting for its TTL.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.srem(self.ns.role_key(role), worker_id)
            pipe.delete(self.ns.worker_key(worker_id))
            await pipe.execute()

    async def live_workers(self, role: Role) -> list[WorkerInfo]:
        """Return the live workers of ``role`` with their last reported load (one round trip).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        replies = await self._live_workers(keys=[self.ns.role_key(role)], args=[self.ns.worker_key("")])
        workers = []
        for fields in replies:
            try:
                workers.append(WorkerInfo.from_fields(fields))
            except (KeyError, ValueError) as exc:  # e.g. a worker of another version mid-upgrade
                logger.warning("skipping unreadable %s worker entry %r: %s", role, fields, exc)
        return sorted(workers, key=lambda w: w.worker_id)


class BlockEventSource(Protocol):
    """What :class:`Heartbeat` reads from a worker's prefix cache (``engine.block_pool.BlockPool``)."""

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
        interval_s: float = 1.0,
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
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start beating in the background (call from the running event loop).

        Raises:
            RuntimeError: already started.
        """
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"heartbeat-{self.worker.worker_id}")

    async def stop(self) -> None:
        """Stop beating and deregister (best effort: if Redis is down the entries expire)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
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
        current = WorkerInfo(self.worker.worker_id, self.worker.role, self.worker.address, self._load())
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

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                await self.beat()
                if failing:
                    logger.info("heartbeat of %s reaches Redis again", self.worker.worker_id)
                failing = False
            except REDIS_ERRORS as exc:
                if not failing:
                    logger.warning("heartbeat of %s failed (%s); retrying every %.1f s",
                                   self.worker.worker_id, exc, self.interval_s)
                failing = True
            except Exception:  # a bug in a callback must not kill the worker's registration
                logger.exception("heartbeat of %s failed", self.worker.worker_id)
            await asyncio.sleep(self.interval_s)
