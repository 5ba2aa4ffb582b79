"""Quarantine of prefill workers caught sending wrong KV by a decode worker's spot check
(``decode_worker.spot_check``): routing sends them no prompt until the quarantine ends, and then
asks a spot check of every request they prefill for as long again (probation).

A quarantine is a record with a reason and an expiry. With Redis it is the hash
``{ns}:quarantine:{worker_id}`` (``reason``, ``by``: the gateway that wrote it) living
``quarantine_s`` (Redis' own key expiry decides its end, as for registry entries), listed in the
set ``{ns}:quarantined``, so every gateway of the deployment stops routing to the worker at its
next refresh; without Redis (static workers) it lives in this gateway's memory. Each quarantine
is logged (ERROR) and the quarantined workers are the ``tandem_gateway_quarantined_workers`` gauge.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import redis.asyncio as redis

from cluster.registry import REDIS_ERRORS, ClusterNamespace
from gateway import metrics

logger = logging.getLogger(__name__)

# KEYS[1]: the set of quarantined ids. ARGV[1]: the record key prefix ("{ns}:quarantine:").
# Returns [id, reason, milliseconds left, ...] per live record; drops ids whose record expired.
_ACTIVE_LUA = """
local active = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local reason = redis.call('HGET', ARGV[1] .. id, 'reason')
  if reason then
    active[#active + 1] = id
    active[#active + 1] = reason
    active[#active + 1] = redis.call('PTTL', ARGV[1] .. id)
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return active
"""


class Quarantine:
    """The quarantined workers, in Redis or (``client`` ``None``) in memory.

    Args:
        client: the gateway's Redis client (``None``: static workers, memory only).
        ns: the registry's namespace.
        quarantine_s: seconds a quarantine lasts; probation lasts as long after it.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, client: redis.Redis | None, ns: ClusterNamespace, quarantine_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.ns, self.quarantine_s = client, ns, quarantine_s
        self._clock = clock
        self._active: dict[str, str] = {}  # worker id -> reason
        self._until: dict[str, float] = {}  # worker id -> when this gateway's own record ends (memory)
        self._ends: dict[str, float] = {}  # worker id -> when its last known quarantine ends
        self._read = client.register_script(_ACTIVE_LUA) if client is not None else None

    @property
    def set_key(self) -> str:
        return f"{self.ns.root}:quarantined"

    def record_key(self, worker_id: str) -> str:
        return f"{self.ns.root}:quarantine:{worker_id}"

    def active(self) -> dict[str, str]:
        """Quarantined worker id → reason, as of the last :meth:`refresh` or :meth:`add`."""
        return dict(self._active)

    def quarantined(self, worker_id: str) -> bool:
        return worker_id in self._active

    def on_probation(self, worker_id: str) -> bool:
        """Quarantined, or released within the last ``quarantine_s``: each request it prefills
        is spot-checked."""
        end = self._ends.get(worker_id)
        return end is not None and self._clock() - end < self.quarantine_s

    async def add(self, worker_id: str, reason: str) -> None:
        """Quarantine ``worker_id`` for ``quarantine_s`` (routing skips it at once; with Redis,
        every gateway at its next refresh). A Redis error is logged: this gateway's memory holds
        the quarantine meanwhile."""
        now = self._clock()
        logger.error("quarantining worker %s for %.0f s: %s", worker_id, self.quarantine_s, reason)
        self._active[worker_id] = reason
        self._until[worker_id] = self._ends[worker_id] = now + self.quarantine_s
        metrics.QUARANTINED_WORKERS.set(len(self._active))
        if self.client is None:
            return
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(self.record_key(worker_id), mapping={"reason": reason, "by": socket.gethostname()})
                pipe.pexpire(self.record_key(worker_id), round(self.quarantine_s * 1000))
                pipe.sadd(self.set_key, worker_id)
                await pipe.execute()
        except REDIS_ERRORS as exc:
            logger.warning("cannot record the quarantine of %s in Redis (%s): this gateway keeps it", worker_id, exc)

    async def refresh(self) -> None:
        """Re-read the quarantined workers: every gateway's records in Redis (while it is
        unreachable, the last-known ones until their ends) and this gateway's own not yet ended
        (one it could not write to Redis included)."""
        now = self._clock()
        self._until = {w: t for w, t in self._until.items() if t > now}
        active = {w: self._active[w] for w in self._until}
        if self._read is not None:
            try:
                flat = await self._read(keys=[self.set_key], args=[self.record_key("")])
            except REDIS_ERRORS:  # Redis lost: the last-known quarantines hold until their ends
                active |= {w: r for w, r in self._active.items() if self._ends.get(w, now) > now}
                flat = []
            for worker_id, reason, left_ms in zip(flat[::3], flat[1::3], flat[2::3]):
                active[worker_id.decode()] = reason.decode()
                self._ends[worker_id.decode()] = max(self._ends.get(worker_id.decode(), now),
                                                     now + max(0, int(left_ms)) / 1000)
        for worker_id, reason in active.items():
            if worker_id not in self._active:
                logger.error("worker %s is quarantined: %s", worker_id, reason)
        for worker_id in self._active.keys() - active.keys():
            logger.warning("worker %s's quarantine ended: its requests are spot-checked for %.0f s", worker_id,
                           self.quarantine_s)
        self._ends = {w: t for w, t in self._ends.items() if now - t < self.quarantine_s}
        self._active = active
        metrics.QUARANTINED_WORKERS.set(len(active))
