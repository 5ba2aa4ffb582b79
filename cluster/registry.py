"""Worker registry in Redis: who is alive, where, how configured, and how loaded.

Each worker keeps a hash ``{ns}:worker:{id}`` (role, address, the cache settings it owns and
publishes, load) alive with a heartbeat
every ``interval_s``; the hash carries a TTL of ``ns.ttl_s``, so a worker that stops beating
disappears on its own. A per-role set ``{ns}:workers:{role}`` lists the ids; the gateway
reads a role's live workers in one round trip with a Lua script that also prunes ids whose
hash has expired. Liveness is decided by Redis' own key expiry, never by comparing clocks of
different hosts. ``{ns}`` is ``tandem:{key_prefix}``: every worker of a deployment registers
there whatever its model or block size, so a gateway sees (and refuses, saying why) a worker
that disagrees with the pool instead of silently missing it.

The worker side, which keeps an entry alive, is :class:`cluster.heartbeat.Heartbeat`.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field, fields, replace

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

# Everything a lost or slow Redis raises (redis-py wraps socket errors; TimeoutError is an OSError).
REDIS_ERRORS = (RedisError, OSError)
REDIS_MAX_CONNECTIONS = 32  # per process: Redis commands in flight at once (each a round trip of ~0.1 ms)

_WORKER_ID = re.compile(r"[A-Za-z0-9._-]+")

# KEYS[1]: the role's id set. ARGV[1]: the worker-hash key prefix ("{ns}:worker:").
# Returns one [flat [field, value, ...] array, remaining TTL in ms] pair per live worker; drops
# ids whose hash expired. A heartbeat sets the TTL, so TTL minus what remains is the entry's age
# by Redis' own clock.
_LIVE_WORKERS_LUA = """
local live = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. id
  local fields = redis.call('HGETALL', key)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)
  else
    live[#live + 1] = {fields, redis.call('PTTL', key)}
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
        ttl_s: seconds a worker's entries live after its last heartbeat (> its interval).

    Raises:
        ValueError: an empty ``key_prefix`` or ``ttl_s <= 0``.
    """

    key_prefix: str
    ttl_s: float

    def __post_init__(self) -> None:
        if not self.key_prefix:
            raise ValueError("key_prefix must not be empty")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")

    @property
    def root(self) -> str:
        return f"tandem:{self.key_prefix}"

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
    """A worker's load at its last heartbeat (counts of sequences and KV blocks), and how old
    that measurement was when it was read (``age_s``, seconds; not part of equality)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    age_s: float = field(default=0.0, compare=False)

    @property
    def num_seqs(self) -> int:
        """Sequences running or queued on the worker."""
        return self.running + self.waiting


@dataclass(frozen=True)
class WorkerConfig:
    """The settings a worker owns and publishes (registry entry and ``GetStats``); every worker
    of a pool must agree on them, and the gateway reads them instead of guessing.

    Attributes:
        model_id: the served model's id.
        block_size: tokens per KV block.
        max_model_len: prompt + generated tokens per sequence at most.
        kv_cache_dtype: the KV cache's dtype name (``"bfloat16"``, ...).
        hash_seed: the seed of the chained block hashes (``engine.block_hash.hash_seed``), 16 bytes.
        vocab_size: every token id is below it.
        tensor_parallel_size: the worker's ranks; rank ``r`` holds KV heads ``[r H/T, (r+1) H/T)``
            of every block (the worker's KV layout: :mod:`kvtransfer.pool`).
        kv_transports: the KV transports the worker moves blocks with, preferred first.
        quantization: how the worker holds the weights (``engine.config.QUANTIZATIONS``,
            resolved: ``"none"`` or ``"gguf"``); workers of a pool agree on it.
        max_num_batched_tokens: tokens one engine step computes at most (its prefill chunk):
            bounds how much a prefill on the worker stretches the step of its running sequences;
            ``0``: not published.
        device_ids: the GPUs the worker's ranks run on (``engine.runner.devices.device_ids``; none on a
            CPU or where not published): a prefill worker that shares one with a decode worker
            shares its compute too (``gateway.placement``).
        serves_prefill: a decode worker that also serves ``tandem.v1.PrefillWorker`` on its
            address: it prefills a prompt for another decode worker and sends it the KV, as a
            prefill worker does (the gateway's ``lent`` placement, ``gateway.placement``); always
            ``False`` for a prefill worker.
    """

    model_id: str
    block_size: int
    max_model_len: int
    kv_cache_dtype: str
    hash_seed: bytes
    vocab_size: int
    tensor_parallel_size: int = 1
    kv_transports: tuple[str, ...] = ("grpc",)
    quantization: str = "none"
    max_num_batched_tokens: int = 0
    device_ids: tuple[str, ...] = ()
    serves_prefill: bool = False

    def differences(self, other: WorkerConfig) -> list[str]:
        """Names of the fields where ``other`` differs and may not: every field but
        ``max_model_len`` (workers with less KV memory may hold shorter sequences; a pool serves
        the shortest of its workers' lengths), the step's token budget, and the worker's own KV
        layout (tensor-parallel size, transports: :func:`kv_pairing_problem` says which pairs can
        exchange KV), its GPUs and whether it also serves prefill."""
        return [f.name for f in fields(self)
                if f.name not in _PER_WORKER and getattr(self, f.name) != getattr(other, f.name)]

    def pool_key(self) -> WorkerConfig:
        """This config with the fields a pool's workers may differ in cleared: equal for every
        worker that can join the same pool."""
        return replace(self, **{name: _CLEARED[name] for name in _PER_WORKER})


# WorkerConfig fields in which the workers of a pool may differ.
_CLEARED = {"max_model_len": 0, "tensor_parallel_size": 0, "kv_transports": (), "max_num_batched_tokens": 0,
            "device_ids": (), "serves_prefill": False}
_PER_WORKER = tuple(_CLEARED)


def kv_pairing_problem(prefill: WorkerConfig, decode: WorkerConfig) -> str | None:
    """Why a prefill worker cannot send its KV to a decode worker (``None``: it can).

    Any two tensor-parallel sizes pair up (each decode rank reads the head slices it owns from
    the prefill ranks that hold them, or whole blocks cross in the gRPC stream); what cannot be
    mapped is a pair without a KV transport in common.
    """
    if not set(prefill.kv_transports) & set(decode.kv_transports):
        return (f"no KV transport in common (prefill sends by {list(prefill.kv_transports)}, decode takes "
                f"{list(decode.kv_transports)})")
    return None


def shares_device(a: WorkerConfig, b: WorkerConfig) -> bool:
    """Whether two workers run on a common GPU (their published ``device_ids``; a CPU worker
    publishes none and shares nothing)."""
    return bool(set(a.device_ids) & set(b.device_ids))


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker: identity, gRPC address (``host:port``), published config and load.

    Raises:
        ValueError: ``worker_id`` is empty or has characters outside ``[A-Za-z0-9._-]``.
    """

    worker_id: str
    role: Role
    address: str
    config: WorkerConfig
    load: WorkerLoad = WorkerLoad()

    def __post_init__(self) -> None:
        if not _WORKER_ID.fullmatch(self.worker_id):
            raise ValueError(f"worker_id must match [A-Za-z0-9._-]+, got {self.worker_id!r}")

    def to_fields(self) -> dict[str, str | int]:
        c, load = self.config, self.load
        return {
            "worker_id": self.worker_id, "role": self.role.value, "address": self.address,
            "model_id": c.model_id, "block_size": c.block_size, "max_model_len": c.max_model_len,
            "kv_cache_dtype": c.kv_cache_dtype, "hash_seed": c.hash_seed.hex(), "vocab_size": c.vocab_size,
            "tensor_parallel_size": c.tensor_parallel_size, "kv_transports": ",".join(c.kv_transports),
            "quantization": c.quantization, "max_num_batched_tokens": c.max_num_batched_tokens,
            "device_ids": ",".join(c.device_ids), "serves_prefill": int(c.serves_prefill),
            "running": load.running, "waiting": load.waiting, "free_blocks": load.free_blocks,
            "total_blocks": load.total_blocks,
        }

    @classmethod
    def from_fields(cls, flat: list[bytes]) -> WorkerInfo:
        """Parse HGETALL's flat ``[field, value, ...]`` reply.

        Raises:
            KeyError, ValueError: a field is missing or malformed.
        """
        f = {k.decode(): v.decode() for k, v in zip(flat[::2], flat[1::2])}
        config = WorkerConfig(f["model_id"], int(f["block_size"]), int(f["max_model_len"]), f["kv_cache_dtype"],
                              bytes.fromhex(f["hash_seed"]), int(f["vocab_size"]), int(f["tensor_parallel_size"]),
                              tuple(f["kv_transports"].split(",")), f["quantization"],
                              int(f.get("max_num_batched_tokens", 0)),  # (not in entries of older workers)
                              tuple(filter(None, f.get("device_ids", "").split(","))),
                              f.get("serves_prefill", "0") == "1")
        load = WorkerLoad(int(f["running"]), int(f["waiting"]), int(f["free_blocks"]), int(f["total_blocks"]))
        return cls(f["worker_id"], Role(f["role"]), f["address"], config, load)


def redis_client(url: str, timeout_s: float = 0.5, retries: int = 1, password: str = "",
                 tls_ca: str = "", max_connections: int = REDIS_MAX_CONNECTIONS) -> redis.Redis:
    """Return a ``redis.asyncio`` client suited to routing: bytes replies, short timeouts, a
    bounded pool of connections.

    redis-py's defaults (5 s timeouts, 10 retries) would stall every heartbeat and refresh for
    many seconds while Redis is down; here a lost Redis fails within about
    ``(retries + 1) * timeout_s`` seconds and the callers fall back to last-known state. Its
    default pool opens a connection for every concurrent command, keeps them all, and fails
    the command beyond 100 (``MaxConnectionsError``: a burst of requests would put routing in
    its Redis-lost mode). Here at most ``max_connections`` are open, and a command waits up to
    ``timeout_s`` for one (then ``redis.exceptions.ConnectionError``, as for a lost Redis).

    Args:
        url: e.g. ``redis://127.0.0.1:6379/0``.
        timeout_s: connect, socket and pool-wait timeout in seconds.
        retries: extra attempts on connection errors.
        password: Redis AUTH password (empty: the URL's, if any).
        tls_ca: CA file that verifies the server's certificate (a ``rediss://`` URL).
        max_connections: connections open at most.
    """
    extra = {"password": password} if password else {}
    if tls_ca:
        extra["ssl_ca_certs"] = tls_ca
    pool = redis.BlockingConnectionPool.from_url(
        url,
        **extra,
        max_connections=max_connections,
        timeout=timeout_s,
        decode_responses=False,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=timeout_s, base=0.01), retries),
    )
    return redis.Redis.from_pool(pool)


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
        """Return the live workers of ``role`` with their last reported load (one round trip);
        each load's ``age_s`` is the time since its heartbeat by Redis' clock (the TTL the beat
        set minus what remains of it).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        replies = await self._live_workers(keys=[self.ns.role_key(role)], args=[self.ns.worker_key("")])
        workers = []
        for flat, ttl_left_ms in replies:
            try:
                worker = WorkerInfo.from_fields(flat)
            except (KeyError, ValueError) as exc:  # e.g. a worker of another version mid-upgrade
                logger.warning("skipping unreadable %s worker entry %r: %s", role, flat, exc)
                continue
            age_s = max(0, self.ns.ttl_ms - ttl_left_ms) / 1000 if ttl_left_ms >= 0 else 0.0
            workers.append(replace(worker, load=replace(worker.load, age_s=age_s)))
        return sorted(workers, key=lambda w: w.worker_id)
