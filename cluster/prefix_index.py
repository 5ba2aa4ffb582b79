"""Prefix index in Redis: which worker's prefix cache holds which block hash.

Each worker owns one set ``{ns}:worker:{id}:blocks`` of the 16-byte chained block hashes
(``engine.block_hash``) in its prefix cache. The set carries the same TTL as the worker's
registry entry and its heartbeat refreshes both, so a dead worker's blocks vanish from
routing on their own. Workers publish batched stored/removed events once per heartbeat and
replace the whole set (a resync) when Redis may have lost or missed something. The gateway
asks, for a request's chain ``[h0..hn-1]``, how many leading hashes each worker holds: one
SMISMEMBER per worker, all in one pipeline. Since ``h_i`` names the whole prefix up to
block ``i``, only the leading run counts: a worker holding h0, h1, h3 can reuse 2 blocks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable, Sequence

import redis.asyncio as redis

from cluster.registry import ClusterNamespace

# SADD arguments per command in a resync (keeps each command's request buffer bounded).
_RESYNC_CHUNK = 10_000


def net_events(stored: Iterable[bytes], removed: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
    """Collapse one batch of events into the hashes to add and to remove.

    A pool's events for one hash alternate (stored, removed, stored, ...: it is stored only
    while not cached and removed only while cached), so per hash the batch's net count is
    +1 (now cached), -1 (now gone) or 0 (same as before the batch: nothing to write).

    Returns:
        ``(to_add, to_remove)``, disjoint.
    """
    net = Counter(stored)
    net.subtract(removed)
    return [h for h, n in net.items() if n > 0], [h for h, n in net.items() if n < 0]


def leading_run(held: Sequence[int | bool]) -> int:
    """Return how many leading entries of ``held`` are true (blocks of reusable prefix)."""
    for i, flag in enumerate(held):
        if not flag:
            return i
    return len(held)


class PrefixIndex:
    """Block hash → workers, one Redis set per worker, in the namespace ``ns``."""

    def __init__(self, client: redis.Redis, ns: ClusterNamespace) -> None:
        self.client = client
        self.ns = ns

    async def publish(self, worker_id: str, stored: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """Apply one batch of the worker's block events and refresh the set's TTL (one transaction).

        Args:
            worker_id: the publishing worker.
            stored: hashes that entered its prefix cache since the last batch, in order.
            removed: hashes that left it since the last batch, in order.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable; the batch is lost and the
                worker must :meth:`resync`.
        """
        to_add, to_remove = net_events(stored, removed)
        key = self.ns.blocks_key(worker_id)
        async with self.client.pipeline(transaction=True) as pipe:
            if to_remove:
                pipe.srem(key, *to_remove)
            if to_add:
                pipe.sadd(key, *to_add)
            pipe.pexpire(key, self.ns.ttl_ms)
            await pipe.execute()

    def note_routed(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """Nothing to do: with Redis, the workers' own block events are the truth."""

    async def resync(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Replace the worker's whole set with ``hashes`` atomically (on (re)connect).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        key = self.ns.blocks_key(worker_id)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            members = list(hashes)
            for start in range(0, len(members), _RESYNC_CHUNK):
                pipe.sadd(key, *members[start : start + _RESYNC_CHUNK])
            pipe.pexpire(key, self.ns.ttl_ms)
            await pipe.execute()

    async def drop(self, worker_id: str) -> None:
        """Delete the worker's set now (a clean shutdown).

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
        """
        await self.client.delete(self.ns.blocks_key(worker_id))

    async def cached_runs(self, worker_ids: Sequence[str], block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Return, per worker, the number of leading ``block_hashes`` it caches (in blocks).

        Args:
            worker_ids: the candidate workers (normally the live prefill workers).
            block_hashes: the request's chained hashes ``[h0..hn-1]`` of its full blocks.

        Raises:
            redis.exceptions.RedisError, OSError: Redis unreachable.
            asyncio.CancelledError: the calling task was cancelled during the lookup, even where
                redis-py returned the replies instead (see :func:`_raise_lost_cancellation`).
        """
        if not worker_ids or not block_hashes:
            return dict.fromkeys(worker_ids, 0)
        async with self.client.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.smismember(self.ns.blocks_key(worker_id), list(block_hashes))
            replies = await pipe.execute()
        _raise_lost_cancellation()
        return {w: leading_run(held) for w, held in zip(worker_ids, replies)}


def _raise_lost_cancellation() -> None:
    """Raise ``CancelledError`` in a task cancelled while it awaited a Redis reply that came
    anyway.

    On Python 3.11 ``asyncio.wait_for``, which redis-py wraps around a command's send, returns
    its inner result and drops a cancellation that lands as the inner call finishes (CPython
    gh-86296, fixed in 3.12 by gh-96764). The task's own count of pending cancellations
    (``Task.cancelling``) still records it: a gateway request whose client cancelled during its
    prefix lookup would otherwise go on to reserve blocks and prefill for nobody (262 of 600
    cancels at random points of a lookup against a local Redis were lost so).
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
