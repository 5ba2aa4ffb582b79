"""Routing: pick a prefill worker and a decode worker for one request.

The picks are pure functions of worker lists (no Redis, no clock; randomness injected).
:class:`ClusterView` is the gateway's facade over them: it keeps the last-known workers
from the registry, adjusts their reported load by the requests this gateway routed since,
and asks the prefix index how much of the prompt each prefill worker has cached. When Redis
is unreachable it routes on last-known workers and load alone (``degraded``), and returns to
prefix-aware routing at the first refresh that reaches Redis again.

Prefill score of worker ``w`` (higher wins), in tokens of prefill work:

    score(w) = block_size * cached_blocks(w) - load_cost_tokens * (running(w) + waiting(w))

i.e. the prompt tokens ``w`` need not compute, minus the work assumed queued ahead of the
request (``load_cost_tokens`` per sequence already on ``w``). Ties go to the less loaded
worker, then to a random one, so equal workers share the traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.prefix_index import PrefixIndex
from gateway.registry import REDIS_ERRORS, Role, WorkerInfo, WorkerLoad, WorkerRegistry

logger = logging.getLogger(__name__)


class NoWorkerError(RuntimeError):
    """No live worker of a role is known (the gateway answers UNAVAILABLE)."""


class NoCapacityError(RuntimeError):
    """Decode workers are live but none has the free blocks (the gateway answers RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class RoutingPolicy:
    """Knobs of the routing functions.

    Args:
        load_cost_tokens: prefill tokens one running or waiting sequence on a worker is
            assumed to cost the next request (about a typical prompt's length).
        decode_margin_blocks: free blocks a decode worker must have beyond the prompt's,
            for the first generated tokens.

    Raises:
        ValueError: a negative value.
    """

    load_cost_tokens: int = 512
    decode_margin_blocks: int = 2

    def __post_init__(self) -> None:
        for name in ("load_cost_tokens", "decode_margin_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def _cdiv(a: int, b: int) -> int:
    """Ceil division (engine.kv_cache_manager has one too, but importing it pulls in torch)."""
    return -(-a // b)


def prefill_score(cached_blocks: int, load: WorkerLoad, block_size: int, policy: RoutingPolicy) -> int:
    """Return the prefill score in tokens (module docstring: prompt tokens saved minus queued work)."""
    return block_size * cached_blocks - policy.load_cost_tokens * load.num_seqs


def _pick_best(
    workers: Sequence[WorkerInfo], key: Callable[[WorkerInfo], tuple[int, int]], rng: random.Random
) -> WorkerInfo:
    """Return a random one of the workers with the smallest ``key``."""
    best = min(key(w) for w in workers)
    return rng.choice([w for w in workers if key(w) == best])


def pick_prefill(
    workers: Sequence[WorkerInfo],
    cached_blocks: Mapping[str, int],
    block_size: int,
    policy: RoutingPolicy,
    rng: random.Random,
) -> WorkerInfo | None:
    """Return the prefill worker with the highest :func:`prefill_score`, or ``None`` if none.

    Args:
        workers: candidate prefill workers with their (estimated) load.
        cached_blocks: worker id → leading blocks of the prompt it caches; an empty mapping
            routes on load alone (the mode used while Redis is unreachable).
        block_size: tokens per block.
        policy: the scoring knobs.
        rng: breaks ties left after the score and the load.
    """
    if not workers:
        return None

    def key(w: WorkerInfo) -> tuple[int, int]:
        return -prefill_score(cached_blocks.get(w.worker_id, 0), w.load, block_size, policy), w.load.num_seqs

    return _pick_best(workers, key, rng)


def pick_decode(
    workers: Sequence[WorkerInfo], prompt_blocks: int, policy: RoutingPolicy, rng: random.Random
) -> WorkerInfo | None:
    """Return the least loaded decode worker with ``prompt_blocks + decode_margin_blocks`` free
    blocks (ties: most free blocks, then random), or ``None`` if no worker has them."""
    needed = prompt_blocks + policy.decode_margin_blocks
    fitting = [w for w in workers if w.load.free_blocks >= needed]
    if not fitting:
        return None
    return _pick_best(fitting, lambda w: (w.load.num_seqs, -w.load.free_blocks), rng)


@dataclass(frozen=True)
class Route:
    """Where one request goes.

    Attributes:
        prefill: the chosen prefill worker (load as estimated when routing).
        decode: the chosen decode worker (load as estimated when routing).
        cached_blocks: leading prompt blocks already in ``prefill``'s prefix cache.
        prompt_blocks: blocks the prompt needs on ``decode``.
    """

    prefill: WorkerInfo
    decode: WorkerInfo
    cached_blocks: int
    prompt_blocks: int


class _InFlight:
    """Requests (and decode blocks) this gateway has routed and not yet seen finish, per worker.

    The registry reports each worker's load at its last heartbeat; the change in these counts
    since the last refresh is added to it, so a burst between two refreshes spreads out, and
    routing on last-known state during a Redis outage still follows the gateway's own traffic.
    """

    def __init__(self) -> None:
        self.seqs: Counter[str] = Counter()
        self.blocks: Counter[str] = Counter()
        self._seqs_at_refresh: Counter[str] = Counter()
        self._blocks_at_refresh: Counter[str] = Counter()

    def mark_refresh(self) -> None:
        self._seqs_at_refresh = self.seqs.copy()
        self._blocks_at_refresh = self.blocks.copy()

    def estimate(self, worker: WorkerInfo) -> WorkerInfo:
        w, load = worker.worker_id, worker.load
        seqs = max(0, load.num_seqs + self.seqs[w] - self._seqs_at_refresh[w])
        running = min(load.running, seqs)
        free = min(load.total_blocks, max(0, load.free_blocks - self.blocks[w] + self._blocks_at_refresh[w]))
        return dataclasses.replace(worker, load=dataclasses.replace(load, running=running, waiting=seqs - running,
                                                                     free_blocks=free))

    def add(self, worker_id: str, seqs: int, blocks: int = 0) -> None:
        self.seqs[worker_id] += seqs
        self.blocks[worker_id] += blocks
        if self.seqs[worker_id] <= 0 and self.blocks[worker_id] <= 0:
            del self.seqs[worker_id], self.blocks[worker_id]


class ClusterView:
    """The gateway's routing state: last-known workers, their load, and the prefix index.

    Call :meth:`refresh` periodically (about once per heartbeat interval); call
    :meth:`choose` per request, then :meth:`prefill_done` when its prefill ends (first token
    or failure) and :meth:`decode_done` when it ends on the decode worker (any reason).

    Args:
        registry: the namespace's worker registry.
        index: the namespace's prefix index.
        policy: routing knobs.
        rng: tie-breaking randomness (seed it in tests).
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        index: PrefixIndex,
        policy: RoutingPolicy = RoutingPolicy(),
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.index = index
        self.policy = policy
        self._rng = rng or random.Random()
        self._workers: dict[Role, list[WorkerInfo]] = {role: [] for role in Role}
        self._emptied_at: dict[Role, float] = {}
        self._in_flight = _InFlight()
        self._degraded = False

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable: routing uses last-known workers and load only."""
        return self._degraded

    def workers(self, role: Role) -> list[WorkerInfo]:
        """Last-known workers of ``role`` with their load as estimated now."""
        return [self._in_flight.estimate(w) for w in self._workers[role]]

    async def refresh(self) -> None:
        """Re-read live workers and loads; on a Redis error keep last-known state and degrade.

        A role whose workers all vanish at once keeps its last-known list for ``ttl_s``
        seconds: a Redis restart empties the registry until the workers' next heartbeats,
        and routing should not answer UNAVAILABLE meanwhile.
        """
        try:
            fresh = await asyncio.gather(*(self.registry.live_workers(role) for role in Role))
        except REDIS_ERRORS as exc:
            if not self._degraded:
                logger.warning("Redis unreachable (%s): routing on last-known workers and load only", exc)
            self._degraded = True
            return
        if self._degraded:
            logger.info("Redis reachable again: prefix-aware routing resumes")
        self._degraded = False
        now = time.monotonic()
        for role, workers in zip(Role, fresh):
            if workers or not self._workers[role]:
                self._emptied_at.pop(role, None)
                self._workers[role] = workers
            elif now - self._emptied_at.setdefault(role, now) >= self.registry.ns.ttl_s:
                self._workers[role] = []
        self._in_flight.mark_refresh()

    async def choose(self, block_hashes: Sequence[bytes], prompt_len: int, block_size: int) -> Route:
        """Pick the workers for one request and count it as in flight on both.

        Args:
            block_hashes: chained hashes of the prompt's full blocks (``prompt_len // block_size``).
            prompt_len: prompt length in tokens (>= 1).
            block_size: tokens per block; must be the namespace's.

        Raises:
            ValueError: inconsistent arguments.
            NoWorkerError: no live prefill or no live decode worker is known.
            NoCapacityError: no decode worker has the prompt's blocks plus the margin free.
        """
        if block_size != self.registry.ns.block_size:
            raise ValueError(f"block_size={block_size} but this view routes block_size={self.registry.ns.block_size}")
        if prompt_len < 1 or len(block_hashes) != prompt_len // block_size:
            raise ValueError(f"{len(block_hashes)} block hashes do not fit prompt_len={prompt_len}")
        prefills, decodes = self.workers(Role.PREFILL), self.workers(Role.DECODE)
        for role, workers in ((Role.PREFILL, prefills), (Role.DECODE, decodes)):
            if not workers:
                raise NoWorkerError(f"no live {role} worker")
        prompt_blocks = _cdiv(prompt_len, block_size)
        decode = pick_decode(decodes, prompt_blocks, self.policy, self._rng)
        if decode is None:
            raise NoCapacityError(
                f"no decode worker has {prompt_blocks + self.policy.decode_margin_blocks} free blocks "
                f"(most free: {max(w.load.free_blocks for w in decodes)})"
            )
        cached = await self._cached_runs(prefills, block_hashes)
        prefill = pick_prefill(prefills, cached, block_size, self.policy, self._rng)
        assert prefill is not None  # prefills is not empty
        self.index.note_routed(prefill.worker_id, block_hashes)
        self._in_flight.add(prefill.worker_id, 1)
        self._in_flight.add(decode.worker_id, 1, prompt_blocks)
        return Route(prefill, decode, cached.get(prefill.worker_id, 0), prompt_blocks)

    def prefill_done(self, route: Route) -> None:
        """The request's prefill ended (first token sent, or it failed)."""
        self._in_flight.add(route.prefill.worker_id, -1)

    def decode_done(self, route: Route) -> None:
        """The request ended on its decode worker (finished, cancelled or failed)."""
        self._in_flight.add(route.decode.worker_id, -1, -route.prompt_blocks)

    async def _cached_runs(self, prefills: list[WorkerInfo], block_hashes: Sequence[bytes]) -> dict[str, int]:
        if self._degraded:
            return {}
        try:
            return await self.index.cached_runs([w.worker_id for w in prefills], block_hashes)
        except REDIS_ERRORS as exc:
            logger.warning("prefix index unreachable (%s): routing on load only until Redis is back", exc)
            self._degraded = True
            return {}
