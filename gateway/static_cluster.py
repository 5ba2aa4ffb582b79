"""Routing without Redis: a fixed list of worker addresses, loads read with ``GetStats``.

The fallback of ``tandem serve --local`` when no ``redis-server`` exists: the workers run
without a registry and the gateway is given their addresses. :class:`StaticRegistry` stands
in for ``WorkerRegistry`` under the unchanged ``ClusterView`` (same in-flight accounting and
load-only picks); :class:`NoPrefixIndex` reports no cached blocks, so routing is load-only:
prefix caching still works inside each prefill worker, only the gateway cannot aim for it.
"""

from __future__ import annotations

import asyncio
import re

import grpc

from gateway.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad
from protos.tandem.v1 import worker_pb2

_STATS_TIMEOUT_S = 0.5


def static_worker_id(role: Role, address: str) -> str:
    """A registry-style worker id for a fixed address (``prefill-127.0.0.1_50061``)."""
    return f"{role}-{re.sub(r'[^A-Za-z0-9._-]', '_', address)}"


class StaticRegistry:
    """``WorkerRegistry.live_workers`` over fixed addresses: a worker is live while GetStats answers.

    Args:
        clients: ``orchestrator.WorkerClients`` (channels shared with the request path).
        addresses: role → worker addresses.
        ns: the namespace (its ``block_size`` and ``ttl_s`` are what ``ClusterView`` reads).
    """

    def __init__(self, clients, addresses: dict[Role, list[str]], ns: ClusterNamespace) -> None:
        self.clients = clients
        self.addresses = addresses
        self.ns = ns

    async def live_workers(self, role: Role) -> list[WorkerInfo]:
        found = await asyncio.gather(*(self._probe(role, a) for a in self.addresses.get(role, [])))
        return [w for w in found if w is not None]

    async def _probe(self, role: Role, address: str) -> WorkerInfo | None:
        stub = self.clients.prefill(address) if role == Role.PREFILL else self.clients.decode(address)
        try:
            stats = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=_STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        load = WorkerLoad(stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks)
        return WorkerInfo(static_worker_id(role, address), role, address, load)


class NoPrefixIndex:
    """``PrefixIndex.cached_runs`` that knows nothing: routing on load alone."""

    async def cached_runs(self, worker_ids, block_hashes) -> dict[str, int]:
        return {}
