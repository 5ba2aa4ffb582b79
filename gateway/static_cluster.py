"""Routing without Redis: a fixed list of worker addresses, loads read with ``GetStats``.

The fallback of ``tandem serve --local`` when no ``redis-server`` exists: the workers run
without a registry and the gateway is given their addresses. :class:`StaticRegistry` stands
in for ``WorkerRegistry`` under the unchanged ``ClusterView`` (same in-flight accounting and
picks); :class:`RoutedPrefixIndex` stands in for the Redis prefix index, built from the
gateway's own routing decisions, so prefix-aware routing keeps working approximately.
With Redis, :func:`probe_load` reads the last-known workers' loads the same way while Redis is
unreachable.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from cluster.prefix_index import leading_run
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad
from cluster.translate import worker_config_from_proto
from protos.tandem.v1 import worker_pb2

# Seconds a GetStats probe may take (a first TLS handshake on a busy machine takes a good part of
# one): a frozen worker is taken out of routing sooner by the health prober's own deadline.
_STATS_TIMEOUT_S = 2.0


def static_worker_id(role: Role, address: str) -> str:
    """A registry-style worker id for a fixed address (``prefill-127.0.0.1_50061``)."""
    return f"{role}-{re.sub(r'[^A-Za-z0-9._-]', '_', address)}"


class StaticRegistry:
    """A ``router.WorkerDirectory`` over fixed addresses: a worker is live while ``GetStats``
    answers, which also carries its published config.

    Args:
        clients: ``worker_calls.WorkerClients`` (channels shared with the request path).
        addresses: role → worker addresses.
        ns: the namespace (its ``ttl_s`` is what ``ClusterView`` reads).
    """

    def __init__(self, clients, addresses: dict[Role, list[str]], ns: ClusterNamespace) -> None:
        self.clients = clients
        self.addresses = addresses
        self.ns = ns

    async def live_workers(self, role: Role) -> list[WorkerInfo]:
        found = await asyncio.gather(*(self._probe(role, a) for a in self.addresses.get(role, [])))
        return [w for w in found if w is not None]

    async def _probe(self, role: Role, address: str) -> WorkerInfo | None:
        stats = await worker_stats(self.clients, role, address)
        if stats is None:
            return None
        return WorkerInfo(static_worker_id(role, address), role, address, worker_config_from_proto(stats.config),
                          load_of(stats))


async def worker_stats(clients, role: Role, address: str) -> worker_pb2.WorkerStats | None:
    """A worker's ``GetStats`` answer (``None``: it did not answer within ``_STATS_TIMEOUT_S``).

    Args:
        clients: ``worker_calls.WorkerClients``.
    """
    stub = clients.prefill(address) if role == Role.PREFILL else clients.decode(address)
    try:
        return await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=_STATS_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None


def load_of(stats: worker_pb2.WorkerStats) -> WorkerLoad:
    """The load a ``GetStats`` answer reports."""
    return WorkerLoad(stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks)


async def probe_load(clients, worker: WorkerInfo) -> WorkerLoad | None:
    """``worker``'s load read from the worker itself (``ClusterView``'s ``load_probe`` while
    Redis is unreachable; ``None``: it did not answer)."""
    stats = await worker_stats(clients, worker.role, worker.address)
    return None if stats is None else load_of(stats)


class RoutedPrefixIndex:
    """A ``router.PrefixLocator`` in-process and approximate: which prompts this gateway sent to
    which worker.

    With no Redis, workers cannot report their cached blocks, so the gateway remembers what it
    routed (the approach of SGLang's cache-aware router): a worker that prefilled a prompt is
    assumed to hold its full blocks until ``capacity_blocks`` newer hashes push them out (LRU).
    A wrong guess costs only a prefix-cache miss, never a wrong result.

    Args:
        capacity_blocks: hashes remembered per worker.
    """

    def __init__(self, capacity_blocks: int = 1 << 16) -> None:
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    async def cached_runs(self, worker_ids: Sequence[str], block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading ``block_hashes`` it was sent (same contract as
        ``PrefixIndex.cached_runs``)."""
        runs = {}
        for worker_id in worker_ids:
            held = self._held.get(worker_id, {})
            runs[worker_id] = leading_run([h in held for h in block_hashes])
        return runs

    def note_routed(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """Remember that ``worker_id`` prefills a prompt with these full-block hashes."""
        held = self._held.setdefault(worker_id, OrderedDict())
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)
