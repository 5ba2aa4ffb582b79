"""Routing: pick a prefill worker and a decode worker for one request.

The picks are pure functions of worker lists (no Redis, no clock; randomness injected).
:class:`ClusterView` is the gateway's facade over them: it keeps the last-known workers of
the pool from a :class:`WorkerDirectory`, adjusts their reported load by the requests this
gateway routed since, and asks a :class:`PrefixLocator` how much of the prompt each prefill
worker has cached. When the directory is unreachable it routes on last-known workers and load
alone (``degraded``), and returns to prefix-aware routing at the first refresh that reaches
it again.

The pool: every worker publishes the cache settings it owns (``WorkerConfig``). The gateway
accepts the workers of its own model whose settings agree (the pool's settings: the current
ones while any live worker has them, else the most common), and refuses the others with one
log line each and the ``tandem_gateway_refused_workers`` gauge: a worker with another block
size or KV dtype would corrupt transfers or miss every cached prefix. ``max_model_len`` may
differ (a worker with less KV memory holds shorter sequences): the pool serves the shortest.
With an ``identity`` check (the gateway's under TLS with Redis: ``cluster.identity``), an entry
is refused the same way, and counted in ``tandem_gateway_untrusted_workers``, unless the
certificate on its address names its worker id; such entries do not count towards the pool's
settings either. A quarantined worker (``gateway.quarantine``: a spot check caught its KV wrong)
is picked neither to prefill nor to lend.

Score of worker ``w`` (higher wins), in tokens:

    prefill: score(w) = block_size * cached_blocks(w) - load_cost_tokens * (running(w) + waiting(w))
    decode:  score(w) = block_size * cached_blocks(w) - decode_load_cost_tokens * running(w)
                                                      - load_cost_tokens * waiting(w)

i.e. the prompt tokens ``w`` need not compute (prefill) or receive (decode: its prefix cache
holds the previous turns of a chat), minus the work assumed queued ahead of the request
(``load_cost_tokens`` per sequence on a prefill worker, or waiting on a decode worker). A
sequence already decoding costs a new one only a share of each step, far less than a queued
prompt: with one cost for both, a chat's next turn left the worker holding its previous turns
whenever that worker ran one more sequence than another (measured: 67% of multi-turn prompt
blocks reused with two decode workers at 128 streams, against 91% with one). Ties go to the
less loaded worker, then to a random one, so equal workers share the traffic. A decode worker must also have room for
the blocks it does not hold. Prefill workers are optional: without one (or when few tokens are
left after the decode worker's prefix hit) the decode worker prefills itself. A prefill worker is
paired only with a decode worker it can send KV to (a transport in common: any tensor-parallel
sizes pair up); the decode worker is picked first, then the best prefill worker of those.

A route also offers a **lender**: another decode worker that serves prefill (its published
``serves_prefill``), can send KV to the chosen one, runs on none of its GPUs, has room for the
prompt's blocks it does not hold and is neither excluded, down nor ejected; the best of them by
the prefill score (its cached prefix against the sequences it runs and queues). Placement
(``gateway.placement``'s ``lent``) decides whether it prefills; only then is the request counted
on it (:meth:`ClusterView.lend`).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cluster.registry import (
    REDIS_ERRORS, ClusterNamespace, Role, WorkerConfig, WorkerInfo, WorkerLoad, kv_pairing_problem, shares_device,
)
from engine.core.block_pool import cdiv
from gateway import metrics
from gateway.outlier import OutlierDetector
from gateway.quarantine import Quarantine

logger = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    """Where the gateway learns the live workers (Redis: ``cluster.registry.WorkerRegistry``;
    fixed addresses: ``gateway.static_cluster.StaticRegistry``)."""

    ns: ClusterNamespace

    async def live_workers(self, role: Role) -> list[WorkerInfo]:
        """The live workers of ``role`` with their published config and last load.

        Raises:
            redis.exceptions.RedisError, OSError: the directory is unreachable.
        """
        ...


class PrefixLocator(Protocol):
    """Which prefill worker holds which prompt blocks (Redis: ``cluster.prefix_index.PrefixIndex``;
    in-process: ``gateway.static_cluster.RoutedPrefixIndex``)."""

    async def cached_runs(self, worker_ids: Sequence[str], block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading ``block_hashes`` it caches."""
        ...

    def note_routed(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """``worker_id`` will prefill a prompt with these full-block hashes."""
        ...


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
        decode_load_cost_tokens: the same for one sequence running on a decode worker.
        decode_margin_blocks: free blocks a decode worker must have beyond the prompt's,
            for the first generated tokens.

    Raises:
        ValueError: a negative value.
    """

    load_cost_tokens: int = 512
    decode_load_cost_tokens: int = 32
    decode_margin_blocks: int = 2

    def __post_init__(self) -> None:
        for name in ("load_cost_tokens", "decode_load_cost_tokens", "decode_margin_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def prefill_score(cached_blocks: int, load: WorkerLoad, block_size: int, policy: RoutingPolicy) -> int:
    """Return the prefill score in tokens (module docstring: prompt tokens saved minus queued work)."""
    return block_size * cached_blocks - policy.load_cost_tokens * load.num_seqs


def decode_score(cached_blocks: int, load: WorkerLoad, block_size: int, policy: RoutingPolicy) -> int:
    """Return the decode score in tokens (module docstring: prompt tokens not received minus
    the cost of the sequences running and waiting there)."""
    return (block_size * cached_blocks - policy.decode_load_cost_tokens * load.running
            - policy.load_cost_tokens * load.waiting)


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
    workers: Sequence[WorkerInfo], prompt_blocks: int, cached_blocks: Mapping[str, int], block_size: int,
    policy: RoutingPolicy, rng: random.Random,
) -> WorkerInfo | None:
    """Return the decode worker with the highest :func:`decode_score` (its cached prefix vs its
    load) among those with room for the blocks it lacks plus ``decode_margin_blocks`` (ties:
    fewer sequences, most free blocks, then random), or ``None`` if none has room."""
    def missing(w: WorkerInfo) -> int:
        return prompt_blocks - cached_blocks.get(w.worker_id, 0) + policy.decode_margin_blocks

    fitting = [w for w in workers if w.load.free_blocks >= missing(w)]
    if not fitting:
        return None
    return _pick_best(fitting, lambda w: (-decode_score(cached_blocks.get(w.worker_id, 0), w.load, block_size,
                                                        policy), w.load.num_seqs, -w.load.free_blocks), rng)


@dataclass(frozen=True)
class Route:
    """Where one request goes.

    Attributes:
        prefill: the chosen prefill worker (load as estimated when routing); ``None`` when the
            pool has none (the decode worker prefills).
        decode: the chosen decode worker (load as estimated when routing).
        cached_blocks: leading prompt blocks already in ``prefill``'s prefix cache.
        decode_cached_blocks: leading prompt blocks already in ``decode``'s prefix cache.
        prompt_blocks: blocks the prompt needs on ``decode``.
        lender: another decode worker that could prefill the prompt for ``decode`` (module
            docstring; ``None``: none), not counted on until :meth:`ClusterView.lend`.
        lender_cached_blocks: leading prompt blocks already in ``lender``'s prefix cache.
    """

    prefill: WorkerInfo | None
    decode: WorkerInfo
    cached_blocks: int
    decode_cached_blocks: int
    prompt_blocks: int
    lender: WorkerInfo | None = None
    lender_cached_blocks: int = 0


class _InFlight:
    """Requests (and decode blocks) this gateway has routed and not yet seen finish, per worker,
    with when each count changed.

    A worker's load is measured at its heartbeat (``WorkerLoad.age_s`` before it was read); the
    change in these counts since that moment is added to it, so a burst spreads out between two
    heartbeats, a request routed after a beat is not forgotten by a refresh that reads that beat,
    and routing on last-known state during a Redis outage still follows the gateway's own
    traffic. Left uncounted until the next beat: a request routed so shortly before a beat that
    it had not reached the worker yet (its travel time, milliseconds).

    Args:
        horizon_s: the oldest a load can be when it is read (the registry's TTL): changes older
            than that are merged, so the history stays bounded while a load stays last-known.
    """

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        # Per worker: (monotonic time, sequences, blocks in flight after a change), oldest first;
        # the first entry holds the counts as they were when the worker's load was measured, the
        # later ones came after.
        self._history: dict[str, list[tuple[float, int, int]]] = {}
        self._measured_at: dict[str, float] = {}

    def measured_at(self, worker_id: str) -> float:
        """The monotonic time the load in use for ``worker_id`` was measured (``-inf``: never)."""
        return self._measured_at.get(worker_id, -math.inf)

    def measured(self, times: Mapping[str, float]) -> None:
        """The loads in use from now on: worker id → the monotonic time its load was measured;
        workers not named are forgotten (they left the listing)."""
        self._measured_at = dict(times)
        for worker_id, history in list(self._history.items()):
            if worker_id in times:
                del history[:max(0, bisect.bisect_right(history, times[worker_id], key=lambda entry: entry[0]) - 1)]
            else:
                del self._history[worker_id]

    def estimate(self, worker: WorkerInfo) -> WorkerInfo:
        """``worker`` with the sequences and blocks routed to it since its load was measured
        (less those ended) added to its load."""
        history, load = self._history.get(worker.worker_id), worker.load
        if not history:
            return worker
        _, seqs_then, blocks_then = history[0]
        _, seqs_now, blocks_now = history[-1]
        seqs = max(0, load.num_seqs + seqs_now - seqs_then)
        running = min(load.running, seqs)
        free = min(load.total_blocks, max(0, load.free_blocks - blocks_now + blocks_then))
        return dataclasses.replace(worker, load=dataclasses.replace(load, running=running, waiting=seqs - running,
                                                                     free_blocks=free))

    def add(self, worker_id: str, seqs: int, blocks: int = 0) -> None:
        """Count ``seqs`` more sequences and ``blocks`` more KV blocks in flight on ``worker_id``
        (negative: ended)."""
        now = time.monotonic()
        history = self._history.setdefault(worker_id, [(-math.inf, 0, 0)])
        while len(history) > 2 and history[2][0] < now - self.horizon_s:
            del history[1]  # no load read from now on is older than history[2]
        _, seqs_now, blocks_now = history[-1]
        history.append((now, seqs_now + seqs, blocks_now + blocks))


def choose_pool(workers: Sequence[WorkerInfo], current: WorkerConfig | None) -> WorkerConfig | None:
    """The settings the pool runs with (the per-worker fields aside, ``WorkerConfig.pool_key``):
    ``current`` while a worker
    still has them or none is seen (an emptied registry keeps its last-known workers a while),
    else the most common among ``workers`` (ties: those of the smallest worker id)."""
    keys = Counter(w.config.pool_key() for w in workers)
    if not keys or (current is not None and current.pool_key() in keys):
        return current
    best = max(keys.values())
    return min((w for w in workers if keys[w.config.pool_key()] == best), key=lambda w: w.worker_id).config


def refusal(worker: WorkerInfo, model_id: str, pool: WorkerConfig | None) -> str | None:
    """Why ``worker`` cannot join a pool serving ``model_id`` with settings ``pool`` (``None``: it can)."""
    if worker.config.model_id != model_id:
        return f"serves model {worker.config.model_id!r}, this gateway serves {model_id!r}"
    differ = pool.differences(worker.config) if pool is not None else []
    if differ:
        return "disagrees with the pool on " + ", ".join(
            f"{name} ({getattr(worker.config, name)!r} vs {getattr(pool, name)!r})" for name in differ)
    return None


class ClusterView:
    """The gateway's routing state: the pool's live workers, their load, and the prefix index.

    Call :meth:`refresh` periodically (about once per heartbeat interval); call
    :meth:`choose` per request, then :meth:`prefill_done` when its prefill ends (first token
    or failure) and :meth:`decode_done` when it ends on the decode worker (any reason).

    Args:
        registry: where the live workers are listed.
        index: where cached prompt blocks are located.
        model_id: the model this gateway serves; workers of another model are refused.
        policy: routing knobs.
        rng: tie-breaking randomness (seed it in tests).
        outliers: workers to avoid now (down or ejected, :mod:`gateway.outlier`).
        load_probe: reads a worker's load from the worker itself (``None``: it did not answer);
            while the directory is unreachable, :meth:`refresh` reads the last-known workers'
            loads with it, so that a load published just before an outage (a pool full after a
            burst, say) does not hold for the whole outage. Default: none (loads stay as last
            published).
        identity: why a listed worker's entry is not trusted (``None``: it is;
            ``cluster.identity.InstanceVerifier.refusal``). Default: every entry is trusted.
        quarantine: workers a spot check caught sending wrong KV (``gateway.quarantine``): never
            picked to prefill (nor lent) while quarantined. Default: none.
    """

    def __init__(
        self,
        registry: WorkerDirectory,
        index: PrefixLocator,
        model_id: str,
        policy: RoutingPolicy = RoutingPolicy(),
        rng: random.Random | None = None,
        *,
        outliers: OutlierDetector,
        load_probe: Callable[[WorkerInfo], Awaitable[WorkerLoad | None]] | None = None,
        identity: Callable[[WorkerInfo], Awaitable[str | None]] | None = None,
        quarantine: Quarantine | None = None,
    ) -> None:
        self.identity = identity
        self.quarantine = quarantine
        self.registry = registry
        self.outliers = outliers
        self.index = index
        self.model_id = model_id
        self.policy = policy
        self.load_probe = load_probe
        self._rng = rng or random.Random()
        self._workers: dict[Role, list[WorkerInfo]] = {role: [] for role in Role}
        self._emptied_at: dict[Role, float] = {}
        self._in_flight = _InFlight(registry.ns.ttl_s)
        self._degraded = False
        self._pool: WorkerConfig | None = None
        self._refused: dict[str, str] = {}
        self._unpaired: set[tuple[str, str]] = set()  # (prefill, decode) worker ids logged as unpairable

    @property
    def degraded(self) -> bool:
        """True while the directory is unreachable: routing uses last-known workers and load only."""
        return self._degraded

    @property
    def pool(self) -> WorkerConfig | None:
        """The settings every accepted worker publishes, with the shortest ``max_model_len`` of
        them (``None`` before any worker is seen)."""
        return self._pool

    @property
    def routable(self) -> bool:
        """Whether a request can be routed now: the pool has a decode worker (prefill workers
        are optional: a decode worker prefills locally without one)."""
        return bool(self._workers[Role.DECODE])

    def workers(self, role: Role) -> list[WorkerInfo]:
        """Last-known accepted workers of ``role`` with their load as estimated now."""
        return [self._in_flight.estimate(w) for w in self._workers[role]]

    async def refresh(self) -> None:
        """Re-read live workers and loads; on a directory error keep last-known state and degrade.

        A role whose workers all vanish at once keeps its last-known list for ``ttl_s``
        seconds: a Redis restart empties the registry until the workers' next heartbeats,
        and routing should not answer UNAVAILABLE meanwhile.
        """
        started = time.monotonic()  # a load read now was measured its age before this, or later
        if self.quarantine is not None:
            await self.quarantine.refresh()
        try:
            fresh = await asyncio.gather(*(self.registry.live_workers(role) for role in Role))
        except REDIS_ERRORS as exc:
            if not self._degraded:
                logger.warning("Redis unreachable (%s): routing on last-known workers and load only", exc)
            self._degraded = True
            if self.load_probe is not None:
                await self._probe_loads()
            return
        if self._degraded:
            logger.info("Redis reachable again: prefix-aware routing resumes")
        self._degraded = False
        listed = [w for workers in fresh for w in workers]
        untrusted = await self._untrusted(listed)
        ours = [w for w in listed if w.config.model_id == self.model_id and w.worker_id not in untrusted]
        self._pool = choose_pool(ours, self._pool)
        accepted = self._accept(listed, untrusted)
        if accepted:
            self._pool = dataclasses.replace(self._pool, max_model_len=min(w.config.max_model_len for w in accepted))
        now = time.monotonic()
        for role in Role:
            workers = [w for w in accepted if w.role == role]
            if workers or not self._workers[role]:
                self._emptied_at.pop(role, None)
                self._workers[role] = workers
            elif now - self._emptied_at.setdefault(role, now) >= self.registry.ns.ttl_s:
                self._workers[role] = []
        self._loads_measured({w.worker_id: started - w.load.age_s for w in accepted})

    async def _probe_loads(self) -> None:
        """Read the last-known workers' loads from the workers (one that does not answer keeps
        its last-known load and the time it was measured)."""
        measured_at = {}
        for role in Role:
            known, started = self._workers[role], time.monotonic()
            loads = await asyncio.gather(*(self.load_probe(w) for w in known))
            self._workers[role] = [w if load is None else dataclasses.replace(w, load=load)
                                   for w, load in zip(known, loads)]
            measured_at |= {w.worker_id: started for w, load in zip(known, loads) if load is not None}
        self._loads_measured(measured_at)

    def _loads_measured(self, fresh: Mapping[str, float]) -> None:
        """The workers' loads are as just read: ``fresh`` gives, per worker whose load was read,
        the monotonic time it was measured; the others' last-known loads keep theirs."""
        self._in_flight.measured({w.worker_id: fresh.get(w.worker_id, self._in_flight.measured_at(w.worker_id))
                                  for role in Role for w in self._workers[role]})

    async def _untrusted(self, workers: list[WorkerInfo]) -> dict[str, str]:
        """Worker id → why its entry is not trusted (the ``identity`` check), for ``workers``."""
        if self.identity is None:
            return {}
        reasons = await asyncio.gather(*(self.identity(w) for w in workers))
        untrusted = {w.worker_id: reason for w, reason in zip(workers, reasons) if reason is not None}
        metrics.UNTRUSTED_WORKERS.set(len(untrusted))
        return untrusted

    def _accept(self, workers: list[WorkerInfo], untrusted: Mapping[str, str]) -> list[WorkerInfo]:
        """The workers that can join the pool (``untrusted``: ids refused already, with the
        reason); logs each refused one once (per reason)."""
        accepted, refused = [], {}
        for worker in workers:
            reason = untrusted.get(worker.worker_id) or refusal(worker, self.model_id, self._pool)
            if reason is None:
                accepted.append(worker)
                continue
            refused[worker.worker_id] = reason
            if self._refused.get(worker.worker_id) != reason:
                logger.error("refusing %s worker %s at %s: it %s", worker.role, worker.worker_id, worker.address,
                             reason)
        self._refused = refused
        metrics.REFUSED_WORKERS.set(len(refused))
        return accepted

    async def choose(self, block_hashes: Sequence[bytes], prompt_len: int, exclude: frozenset[str] = frozenset()) -> Route:
        """Pick the workers for one request and count it as in flight on both (once: call
        :meth:`prefill_done` and :meth:`decode_done` whatever happens next).

        Args:
            block_hashes: chained hashes of the prompt's full blocks (``prompt_len // block_size``
                of the pool's block size).
            prompt_len: prompt length in tokens (>= 1).
            exclude: worker ids to avoid (they failed this request already). Workers are
                preferred in this order: neither excluded nor down nor ejected; not excluded
                nor down; (decode only) not down; any. A prefill worker is never picked
                excluded, down or quarantined: the decode worker prefills instead. Nor is one on a GPU of
                the chosen decode worker while another can take the request, whatever it
                caches: two processes time-slice a GPU, so its prefill would stall the decode
                worker's batch like a local one (``gateway.placement``'s ``local_shared``). A
                lender is never excluded, down or ejected (module docstring).

        Raises:
            ValueError: inconsistent arguments.
            NoWorkerError: no live decode worker is known.
            NoCapacityError: no decode worker has room for the prompt's blocks plus the margin.
        """
        pool = self._pool
        if pool is None or not self.routable:
            raise NoWorkerError("no live decode worker")
        if prompt_len < 1 or len(block_hashes) != prompt_len // pool.block_size:
            raise ValueError(f"{len(block_hashes)} block hashes do not fit prompt_len={prompt_len}")
        cached = await self._cached_runs([w for role in Role for w in self._workers[role]], block_hashes)
        # From here to counting the request nothing awaits: the loads are estimated after every
        # route chosen meanwhile was counted (two concurrent requests read the same estimate
        # before the lookup above, and both went to one worker).
        down, ejected = self.outliers.avoided()
        quarantined = frozenset(self.quarantine.active()) if self.quarantine is not None else frozenset()
        prefills = _preferred(self.workers(Role.PREFILL),
                              [exclude | down | ejected | quarantined, exclude | down | quarantined])
        decodes = _preferred(self.workers(Role.DECODE), [exclude | down | ejected, exclude | down, down, frozenset()])
        if not decodes:
            raise NoWorkerError("no live decode worker")
        prompt_blocks = cdiv(prompt_len, pool.block_size)
        decode = pick_decode(decodes, prompt_blocks, cached, pool.block_size, self.policy, self._rng)
        if decode is None:
            raise NoCapacityError(
                f"no decode worker has {prompt_blocks + self.policy.decode_margin_blocks} free blocks "
                f"(most free: {max(w.load.free_blocks for w in decodes)})"
            )
        paired = self._paired(prefills, decode)
        elsewhere = [w for w in paired if not shares_device(w.config, decode.config)]
        prefill = pick_prefill(elsewhere or paired, cached, pool.block_size, self.policy, self._rng)
        lender = self._lender(decode, prompt_blocks, cached, exclude | down | ejected | quarantined)
        for worker in (prefill, decode):
            if worker is not None:
                self.index.note_routed(worker.worker_id, block_hashes)
        if prefill is not None:
            self._in_flight.add(prefill.worker_id, 1)
        self._in_flight.add(decode.worker_id, 1, prompt_blocks)
        return Route(prefill, decode, cached.get(prefill.worker_id, 0) if prefill else 0,
                     cached.get(decode.worker_id, 0), prompt_blocks, lender,
                     cached.get(lender.worker_id, 0) if lender else 0)

    def _lender(self, decode: WorkerInfo, prompt_blocks: int, cached: Mapping[str, int],
                avoided: frozenset[str]) -> WorkerInfo | None:
        """The decode worker that could prefill for ``decode`` (module docstring), ``None`` if none."""
        margin = self.policy.decode_margin_blocks
        lenders = [w for w in self.workers(Role.DECODE)
                   if w.config.serves_prefill and w.worker_id != decode.worker_id and w.worker_id not in avoided
                   and not shares_device(w.config, decode.config)
                   and w.load.free_blocks >= prompt_blocks - cached.get(w.worker_id, 0) + margin]
        return pick_prefill(self._paired(lenders, decode), cached, self._pool.block_size, self.policy, self._rng)

    def lend(self, route: Route, block_hashes: Sequence[bytes]) -> Route:
        """Move ``route``'s prefill to its lender (placement chose ``lent``): the request is no
        longer counted on its prefill worker but on the lender, which will cache the prompt's
        blocks (``block_hashes``). Returns the route with the lender as its prefill worker (and
        no lender); call :meth:`prefill_done` with it.

        Raises:
            ValueError: ``route`` has no lender.
        """
        if route.lender is None:
            raise ValueError("the route has no lender")
        self.prefill_done(route)
        self.index.note_routed(route.lender.worker_id, block_hashes)
        self._in_flight.add(route.lender.worker_id, 1)
        return dataclasses.replace(route, prefill=route.lender, cached_blocks=route.lender_cached_blocks, lender=None,
                                   lender_cached_blocks=0)

    def _paired(self, prefills: list[WorkerInfo], decode: WorkerInfo) -> list[WorkerInfo]:
        """The workers of ``prefills`` (prefill workers, or lenders) that can send their KV to
        ``decode``; logs each pair that cannot, once (:func:`cluster.registry.kv_pairing_problem`)."""
        paired = []
        for prefill in prefills:
            problem = kv_pairing_problem(prefill.config, decode.config)
            if problem is None:
                paired.append(prefill)
            elif (prefill.worker_id, decode.worker_id) not in self._unpaired:
                self._unpaired.add((prefill.worker_id, decode.worker_id))
                logger.warning("not pairing %s worker %s with decode worker %s: %s", prefill.role, prefill.worker_id,
                               decode.worker_id, problem)
        return paired

    def prefill_done(self, route: Route) -> None:
        """The request's prefill ended (first token sent, it failed, or the decode worker
        prefills it instead)."""
        if route.prefill is not None:
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


def _preferred(workers: list[WorkerInfo], drops: list[frozenset[str]]) -> list[WorkerInfo]:
    """``workers`` minus the first set of ids in ``drops`` that leaves any; none if none does."""
    for drop in drops:
        kept = [w for w in workers if w.worker_id not in drop]
        if kept:
            return kept
    return []
