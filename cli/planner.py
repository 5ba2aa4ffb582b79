"""P:D planning: how many prefill and decode workers, at which tensor-parallel (TP) sizes, serve a
workload on a given number of GPUs with the most goodput per GPU, predicted from measured rates
(DistServe's placement search and Dynamo's SLA planner do the same: docs/references.md).

Goodput is DistServe's: the highest request rate ``λ*`` (requests/s, Poisson arrivals) at which
at least ``attainment`` of the requests (0.9 by default) meet both objectives, time to first
token ``TTFT <= T`` and time per output token after the first ``TPOT <= τ``. A layout's goodput
per GPU is ``λ*`` over the GPUs it uses; every candidate uses all of them.

**Inputs.** :class:`Rates` (a JSON file, ``deploy/plan/``): per TP size ``t`` the prefill pace
``P_t`` (prompt tokens/s of a worker that only prefills), the decode step time ``s_t(B)`` at
measured batch sizes ``B`` (linear between them, flat below the smallest, extrapolated from the
last two beyond the largest, proportional to ``B`` where only one was measured) at ``x_0`` tokens of context per sequence, the time one step spends
per further context token it reads ``k_t`` (attention reads every token's KV), the KV cache's
size ``K_t`` in tokens; the engine's ``max_num_seqs`` and its chunk ``c``
(``max_num_batched_tokens``). A TP size is a candidate only for the roles it has rates for. A
:class:`Workload`: classes of requests, each a share of them, a prompt length uniform in a range
(integrated over ``_POINTS`` points) and an output length ``O``.

**Routing** (what the gateway does with a fixed split, ``TANDEM_PREFILL_PLACEMENT=static``):
requests spread evenly over the workers of a pool; a prompt of at most ``m`` tokens
(``TANDEM_LOCAL_PREFILL_MAX_TOKENS``), and every prompt where there is no prefill worker, is
prefilled on its decode worker; the others on a prefill worker, whose first token is the
request's. Prefix caching and the KV transfer's time are not modelled (only the last chunk's
transfer is on the TTFT path; a few ms at NVLink rates).

**A prefill worker** is an M/G/1 queue (DistServe models a prefill instance as an M/D/1 one): arrivals ``λ_p`` (its share of
the remote prompts), service ``S = L / P_t`` for a prompt of ``L`` tokens, utilization
``ρ = λ_p E[S]`` below 1, mean wait ``W = λ_p E[S²] / (2 (1 - ρ))`` (Pollaczek-Khinchine), the
wait's distribution taken as ``P(wait > x) = ρ exp(-ρ x / W)`` (exact for exponential service, the
usual approximation otherwise). ``TTFT = wait + S``.

**A decode worker** receives ``λ_d = λ / n_d`` requests/s, ``λ_l`` of them with a local prompt.
Local prefills take ``ρ_l = λ_l E[L_l] / P_t`` of its time, in chunks of ``c`` tokens beside the
decodes (mixed steps); the rest goes to decode steps, so every stream's ``TPOT = s / (1 - ρ_l)``
with ``s = s_t(B) + B (x̄ - x_0) k_t`` the step at the worker's batch ``B`` and mean context ``x̄``
(each request's ``L + O/2`` weighted by its ``O``: a longer stream is in the batch longer). By
Little's law ``B = λ_d E[O - 1] TPOT``: the smallest fixed point (none: the pool is saturated),
within ``max_num_seqs`` and ``B x̄ <= K_t``. A local prefill is an M/G/1 queue of its own on the
worker, service ``L / P_t + ceil(L / c) s`` (each chunk's step carries the batch's decodes), plus
half a step for the one running when the prompt arrives.

A stream's own TPOT is ``s`` plus the stalls of the local prefills computed while it decodes,
over its ``O - 1`` tokens: those that arrive in its ``(O - 1) s / (1 - ρ_l)`` seconds of decoding
and, for a local prompt, those queued behind it (arrived during its wait and prefill). Their
total is a compound Poisson sum of stalls ``L / P_t``, taken as a Poisson count of stalls of one
size matching its mean and variance (size ``E[L²] / (E[L] P_t)``): a short stream meets ``τ``
unless a long prompt lands in its few steps, a long one averages the stalls out. Meeting TTFT
and meeting TPOT are taken as independent.

The gateway's adaptive placement (each prefill moved to where it is predicted to meet the SLOs
better: :mod:`gateway.placement`) is not modelled: the plan is the fixed split's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_POINTS = 32  # prompt lengths a class's uniform range is integrated over
_PRECISION = 1e-4  # λ* is found to this fraction of itself
_SATURATED = "saturated"  # a bound's name prefix (the table's "bound" column)


class PoolRates(BaseModel):
    """What one worker at a tensor-parallel size was measured to do (the module docstring's
    symbols; times in seconds, lengths in tokens).

    Attributes:
        prefill_tokens_per_s: ``P_t``, prompt tokens per second of a worker that only prefills
            (``0``: not measured, the size is no prefill candidate; a decode worker at this size
            then prefills at :meth:`Rates.prefill_pace`).
        decode_step_s: ``s_t(B)``, batch size → seconds of a step in which every running
            sequence decodes (empty: the size is no decode candidate).
        decode_context_tokens: ``x_0``, the mean context per sequence those steps were timed at.
        decode_s_per_context_token: ``k_t``, seconds a step spends per token of context it reads.
        kv_cache_tokens: ``K_t``, tokens the worker's KV cache holds (``0``: not measured, the
            batch is bounded by ``max_num_seqs`` alone).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill_tokens_per_s: float = Field(0.0, ge=0)
    decode_step_s: dict[int, float] = Field(default_factory=dict)
    decode_context_tokens: float = Field(0.0, ge=0)
    decode_s_per_context_token: float = Field(0.0, ge=0)
    kv_cache_tokens: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _positive_steps(self) -> PoolRates:
        for batch, seconds in self.decode_step_s.items():
            if batch < 1 or not seconds > 0:
                raise ValueError(f"decode_step_s: batch {batch} -> {seconds} s; batches must be >= 1, times > 0")
        return self

    def step_s(self, batch: float, context_tokens: float) -> float:
        """``s_t(B)`` at a mean context of ``context_tokens`` per sequence, seconds."""
        points = sorted(self.decode_step_s.items())
        if batch <= points[0][0] or len(points) == 1:
            measured = points[0][1] if batch <= points[0][0] else points[0][1] * batch / points[0][0]
        else:
            i = next((i for i in range(1, len(points)) if batch <= points[i][0]), len(points) - 1)
            (b0, s0), (b1, s1) = points[i - 1], points[i]
            measured = s0 + (s1 - s0) * (batch - b0) / (b1 - b0)
        return measured + batch * (context_tokens - self.decode_context_tokens) * self.decode_s_per_context_token

    def batch_segments(self, context_tokens: float) -> list[tuple[float, float, float, float]]:
        """``s_t`` as linear pieces ``(from_batch, to_batch, intercept_s, slope_s)`` over
        ``[0, inf)`` at ``context_tokens`` of context per sequence."""
        extra = (context_tokens - self.decode_context_tokens) * self.decode_s_per_context_token
        points = sorted(self.decode_step_s.items())
        pieces = [(0.0, float(points[0][0]), points[0][1], extra)]
        if len(points) == 1:
            return pieces + [(float(points[0][0]), math.inf, 0.0, points[0][1] / points[0][0] + extra)]
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            slope = (s1 - s0) / (b1 - b0)
            pieces.append((float(b0), float(b1), s0 - slope * b0, slope + extra))
        last = pieces[-1]
        return pieces + [(last[1], math.inf, last[2], last[3])]


class Rates(BaseModel):
    """Measured rates of one model on one kind of GPU (the planner's input file).

    Attributes:
        model: the model they were measured with.
        gpu: the GPU.
        max_num_batched_tokens: ``c``, the engine's step token budget (its prefill chunk).
        max_num_seqs: sequences in a decode batch at most.
        tensor_parallel: TP size → :class:`PoolRates`.
        sources: free text per figure: which result file it comes from and how (not read).

    Raises (from :meth:`load`):
        ValueError: a field is missing, of the wrong type or out of range (named).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    gpu: str
    max_num_batched_tokens: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    tensor_parallel: dict[int, PoolRates]
    sources: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Rates:
        """Read a rates file.

        Raises:
            OSError: it cannot be read.
            ValueError: it is not JSON, or a field is wrong (the message names it).
        """
        text = Path(path).read_text()
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def sizes(self, role: str) -> list[int]:
        """The TP sizes measured for ``role`` (``"prefill"`` or ``"decode"``), ascending."""
        return sorted(t for t, pool in self.tensor_parallel.items()
                      if (pool.prefill_tokens_per_s if role == "prefill" else pool.decode_step_s))

    @model_validator(mode="after")
    def _prefill_paces(self) -> Rates:
        for t in self.sizes("decode"):
            if not any(p <= t for p in self.sizes("prefill")):
                raise ValueError(f"tensor_parallel: decode is measured at TP {t}, prefill at no TP size up to it "
                                 f"(a decode worker prefills its own short prompts)")
        return self

    def prefill_pace(self, tensor_parallel_size: int) -> float:
        """``P_t``, prompt tokens/s; a size without its own measurement takes the largest
        measured size below it (a worker with more GPUs prefills no slower: a bound from below)."""
        return self.tensor_parallel[max(t for t in self.sizes("prefill") if t <= tensor_parallel_size)] \
            .prefill_tokens_per_s


@dataclass(frozen=True)
class RequestClass:
    """Requests of one kind: ``fraction`` of the workload, prompts of ``prompt_tokens``
    (min, max; uniform, inclusive) tokens, ``output_tokens`` generated each."""

    fraction: float
    prompt_tokens: tuple[int, int]
    output_tokens: int


@dataclass(frozen=True)
class Workload:
    """A mixture of request classes whose fractions sum to 1.

    Raises:
        ValueError: no class, a fraction outside ``(0, 1]``, fractions not summing to 1, an empty
            or non-positive prompt range, fewer than 1 output token.
    """

    name: str
    classes: tuple[RequestClass, ...]

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a workload needs at least one request class")
        for c in self.classes:
            lo, hi = c.prompt_tokens
            if not 0 < c.fraction <= 1 or not 1 <= lo <= hi or c.output_tokens < 1:
                raise ValueError(f"{self.name}: a class needs a fraction in (0, 1], prompt tokens 1 <= min <= max "
                                 f"and >= 1 output token, got {c}")
        if abs(sum(c.fraction for c in self.classes) - 1) > 1e-6:
            raise ValueError(f"{self.name}: the fractions sum to {sum(c.fraction for c in self.classes):g}, not 1")

    def points(self) -> list[tuple[float, float, int]]:
        """``(probability, prompt tokens, output tokens)``: each class's range at ``_POINTS``
        midpoints."""
        out = []
        for c in self.classes:
            lo, hi = c.prompt_tokens
            n = 1 if lo == hi else _POINTS
            out += [(c.fraction / n, lo + (hi - lo) * (i + 0.5) / n, c.output_tokens) for i in range(n)]
        return out


# The serving benchmark's workloads (bench/serving.py; tests/cli/test_planner.py checks they agree).
WORKLOADS = {w.name: w for w in (
    Workload("random", (RequestClass(1.0, (256, 768), 128),)),
    Workload("long", (RequestClass(1.0, (2048, 4096), 256),)),
    Workload("interference", (RequestClass(0.5, (128, 256), 256), RequestClass(0.5, (3072, 4096), 8))),
    Workload("decode_heavy", (RequestClass(1.0, (128, 256), 256),)),
)}


def parse_workload(spec: str) -> Workload:
    """A workload by name (:data:`WORKLOADS`) or as ``FRACTION:MIN-MAX:OUTPUT[,...]`` (a prompt of
    MIN to MAX tokens, OUTPUT tokens generated; ``MIN`` alone for a fixed length).

    Raises:
        ValueError: neither a known name nor a well-formed spec (the message says which part).
    """
    if spec in WORKLOADS:
        return WORKLOADS[spec]
    classes = []
    for part in spec.split(","):
        try:
            fraction, prompt, output = part.split(":")
            lo, _, hi = prompt.partition("-")
            classes.append(RequestClass(float(fraction), (int(lo), int(hi or lo)), int(output)))
        except ValueError:
            raise ValueError(f"workload {spec!r}: one of {sorted(WORKLOADS)}, or FRACTION:MIN-MAX:OUTPUT[,...] "
                             f"(e.g. 0.5:128-256:256,0.5:3072-4096:8); {part!r} is neither") from None
    return Workload(spec, tuple(classes))


@dataclass(frozen=True)
class Objectives:
    """The SLOs goodput counts: TTFT at most ``ttft_s``, TPOT at most ``tpot_s`` (seconds), met
    by at least ``attainment`` of the requests.

    Raises:
        ValueError: an objective <= 0, or ``attainment`` outside ``(0, 1]``.
    """

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and 0 < self.attainment <= 1):
            raise ValueError(f"objectives need ttft_s > 0, tpot_s > 0 and attainment in (0, 1], got {self}")


@dataclass(frozen=True)
class Layout:
    """Workers on a host or cluster: ``prefill_workers`` at ``prefill_tp`` GPUs each (none:
    every decode worker prefills its own prompts, ``prefill_tp`` 0), ``decode_workers`` at
    ``decode_tp``."""

    prefill_workers: int
    prefill_tp: int
    decode_workers: int
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.prefill_workers * self.prefill_tp + self.decode_workers * self.decode_tp

    @property
    def label(self) -> str:
        decode = f"{self.decode_workers}D TP{self.decode_tp}"
        return f"{self.prefill_workers}P TP{self.prefill_tp} + {decode}" if self.prefill_workers else \
            f"{decode} (colocated)"


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted goodput.

    Attributes:
        goodput_rps: ``λ*``, requests/s (``0``: it meets the objectives at no rate).
        per_gpu_rps: ``λ*`` over the layout's GPUs.
        bound: what fails just past ``λ*``: ``"TTFT"``, ``"TPOT"``, or ``"saturated: ..."`` (a
            pool, the batch or the KV cache full).
        attainment: the share of the requests predicted to meet both objectives at ``λ*`` (on an
            idle cluster where ``λ*`` is 0).
    """

    layout: Layout
    goodput_rps: float
    per_gpu_rps: float
    bound: str
    attainment: float


@dataclass(frozen=True)
class Plan:
    """The best layout and every candidate compared, best first."""

    best: Prediction
    candidates: tuple[Prediction, ...]


class ImpossibleObjectives(ValueError):
    """No candidate layout meets the objectives at any rate (the message says why)."""


@dataclass(frozen=True)
class _State:
    """What the model predicts at one rate: the shares of the requests meeting the TTFT
    objective, the TPOT objective, and both."""

    ttft: float
    tpot: float
    both: float


class _Queue:
    """An M/G/1 queue: ``rate`` arrivals/s, service time moments ``mean_s`` and ``square_s2``."""

    def __init__(self, rate: float, mean_s: float, square_s2: float) -> None:
        self.utilization = rate * mean_s
        self.mean_wait_s = rate * square_s2 / (2 * (1 - self.utilization)) if self.utilization < 1 else math.inf

    def wait_at_most(self, seconds: float) -> float:
        """``P(wait <= seconds)`` (module docstring)."""
        if seconds < 0:
            return 0.0
        if self.mean_wait_s == 0:
            return 1.0
        return 1 - self.utilization * math.exp(-self.utilization * seconds / self.mean_wait_s)


def _poisson_cdf(k: int, mean: float) -> float:
    """``P(N <= k)`` for ``N`` Poisson of ``mean`` (normal with continuity correction past a mean
    of 500, where the terms underflow)."""
    if k < 0:
        return 0.0
    if mean > 500:
        return 0.5 * math.erfc(-(k + 0.5 - mean) / math.sqrt(2 * mean))
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
        if term < 1e-17 * total and i > mean:
            break
    return min(total, 1.0)


def _moments(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """``(total probability, E[x], E[x²])`` of ``(probability, x)`` pairs (conditional on them)."""
    total = sum(p for p, _ in points)
    if total == 0:
        return 0.0, 0.0, 0.0
    return total, sum(p * x for p, x in points) / total, sum(p * x * x for p, x in points) / total


def _batch(pool: PoolRates, gain: float, context: float) -> float | None:
    """The smallest ``B`` with ``B = gain * step(B)``; ``None`` when there is none."""
    for lo, hi, intercept, slope in pool.batch_segments(context):
        if gain * slope >= 1:
            continue
        batch = gain * intercept / (1 - gain * slope)
        if lo <= batch <= hi:
            return batch
    return None


def _state(layout: Layout, rate: float, points: Sequence[tuple[float, float, int]], rates: Rates,
           objectives: Objectives, local_prefill_max_tokens: int) -> _State | str:
    """The model at ``rate`` requests/s for a workload's :meth:`Workload.points`, or what
    saturates there."""
    is_remote = [bool(layout.prefill_workers) and L > local_prefill_max_tokens for _, L, _ in points]
    remote = [(p, L) for (p, L, _), r in zip(points, is_remote) if r]
    local = [(p, L) for (p, L, _), r in zip(points, is_remote) if not r]
    ttft = {}  # point index -> P(TTFT <= T)
    if remote:
        pace = rates.prefill_pace(layout.prefill_tp)
        share, mean_l, square_l = _moments(remote)
        prefill = _Queue(rate * share / layout.prefill_workers, mean_l / pace, square_l / pace ** 2)
        if prefill.utilization >= 1:
            return f"{_SATURATED}: prefill workers"
        ttft |= {i: prefill.wait_at_most(objectives.ttft_s - L / pace)
                 for i, ((_, L, _), r) in enumerate(zip(points, is_remote)) if r}
    pool, pace = rates.tensor_parallel[layout.decode_tp], rates.prefill_pace(layout.decode_tp)
    local_share, local_mean, local_square = _moments(local)
    local_rate = rate * local_share / layout.decode_workers
    busy = local_rate * local_mean / pace  # ρ_l
    if busy >= 1:
        return f"{_SATURATED}: local prefills"
    steps = sum(p * (O - 1) for p, _, O in points)  # E[O - 1]
    context = sum(p * O * (L + O / 2) for p, L, O in points) / sum(p * O for p, _, O in points)
    batch = _batch(pool, rate / layout.decode_workers * steps / (1 - busy), context)
    if batch is None or batch > rates.max_num_seqs:
        return f"{_SATURATED}: decode batch past max_num_seqs"
    if pool.kv_cache_tokens and batch * context > pool.kv_cache_tokens:
        return f"{_SATURATED}: decode KV cache"
    step = pool.step_s(batch, context)
    if local:
        chunk = rates.max_num_batched_tokens
        service = {i: L / pace + math.ceil(L / chunk) * step
                   for i, ((_, L, _), r) in enumerate(zip(points, is_remote)) if not r}
        _, mean_s, square_s = _moments([(points[i][0], s) for i, s in service.items()])
        lane = _Queue(local_rate, mean_s, square_s)
        if lane.utilization >= 1:
            return f"{_SATURATED}: local prefills"
        ttft |= {i: lane.wait_at_most(objectives.ttft_s - step / 2 - s) for i, s in service.items()}
        # the prompts that arrive while a local one waits and computes are prefilled after it,
        # while it decodes
        behind = {i: lane.mean_wait_s + s for i, s in service.items()}
    tpot = [_tpot_met(O, behind.get(i, 0.0) if local else 0.0, step, busy, local_rate, local_mean, local_square,
                      pace, objectives.tpot_s) for i, (_, _, O) in enumerate(points)]
    return _State(sum(p * ttft[i] for i, (p, _, _) in enumerate(points)),
                  sum(p * tpot[i] for i, (p, _, _) in enumerate(points)),
                  sum(p * ttft[i] * tpot[i] for i, (p, _, _) in enumerate(points)))


def _tpot_met(output_tokens: int, behind_s: float, step_s: float, busy: float, local_rate: float,
              local_mean: float, local_square: float, pace: float, tpot_s: float) -> float:
    """``P(TPOT <= tpot_s)`` for a stream of ``output_tokens`` on a decode worker whose steps
    take ``step_s`` and whose local prefills (``local_rate`` per second, ``local_mean`` and
    ``local_square`` the moments of their tokens, computed at ``pace`` tokens/s) take ``busy``
    of its time: those arriving while the stream decodes, or in the ``behind_s`` seconds before
    its first token (queued behind its own prefill), stall it by their compute (a compound
    Poisson sum, counted in units matching its mean and variance)."""
    decodes = output_tokens - 1
    budget = decodes * (tpot_s - step_s)  # seconds of stall the stream can absorb
    if decodes == 0 or local_rate == 0:
        return 1.0 if budget >= 0 else 0.0
    unit = local_square / (local_mean * pace)  # seconds per stall unit
    window = behind_s + decodes * step_s / (1 - busy)  # its expected time decoding, and the wait before
    arrivals = local_rate * local_mean ** 2 / local_square * window
    return _poisson_cdf(math.floor(budget / unit), arrivals) if budget >= 0 else 0.0


def predict(layout: Layout, workload: Workload, rates: Rates, objectives: Objectives,
            local_prefill_max_tokens: int = 256) -> Prediction:
    """``layout``'s goodput on ``workload`` (module docstring): the attainment falls with the
    rate, so ``λ*`` is found by bisection between a rate that meets it and one that does not.

    Raises:
        KeyError: the layout uses a TP size ``rates`` has no figures for.
    """
    def attained(state: _State | str) -> float:
        return 0.0 if isinstance(state, str) else state.both

    points = workload.points()

    def at(rate: float) -> _State | str:
        return _state(layout, rate, points, rates, objectives, local_prefill_max_tokens)

    def bound(state: _State | str) -> str:
        return state if isinstance(state, str) else "TPOT" if state.tpot < state.ttft else "TTFT"

    idle = at(1e-9)
    if attained(idle) < objectives.attainment:
        return Prediction(layout, 0.0, 0.0, bound(idle), idle.both if isinstance(idle, _State) else 0.0)
    low, high = 1e-9, 1.0
    while attained(at(high)) >= objectives.attainment:
        low, high = high, 2 * high
    while high - low > _PRECISION * low:
        middle = (low + high) / 2
        low, high = (middle, high) if attained(at(middle)) >= objectives.attainment else (low, middle)
    return Prediction(layout, low, low / layout.gpus, bound(at(high)), at(low).both)


def layouts(gpus: int, rates: Rates) -> list[Layout]:
    """Every layout using exactly ``gpus`` GPUs with at least one decode worker, at the TP sizes
    measured for each role (colocated ones, no prefill worker, included).

    Raises:
        ValueError: ``gpus`` < 1.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    found = []
    for decode_tp in rates.sizes("decode"):
        for decode_workers in range(1, gpus // decode_tp + 1):
            left = gpus - decode_workers * decode_tp
            if left == 0:
                found.append(Layout(0, 0, decode_workers, decode_tp))
            found += [Layout(left // tp, tp, decode_workers, decode_tp) for tp in rates.sizes("prefill")
                      if left % tp == 0 and left > 0]
    return found


def plan(gpus: int, workload: Workload, rates: Rates, objectives: Objectives,
         local_prefill_max_tokens: int = 256) -> Plan:
    """The layout of ``gpus`` GPUs with the highest predicted goodput per GPU (ties: fewer
    prefill workers, then smaller TP sizes), and every candidate, best first.

    Raises:
        ValueError: no candidate layout (``gpus`` smaller than every measured TP size).
        ImpossibleObjectives: none meets the objectives at any rate; the message names the
            objective out of reach and the best the rates allow.
    """
    candidates = [predict(layout, workload, rates, objectives, local_prefill_max_tokens)
                  for layout in layouts(gpus, rates)]
    if not candidates:
        raise ValueError(f"no layout fits {gpus} GPUs with the TP sizes measured ({rates.sizes('decode')} for decode)")
    ranked = sorted(candidates, key=lambda c: (-c.per_gpu_rps, c.layout.prefill_workers, c.layout.decode_tp,
                                               c.layout.prefill_tp))
    if ranked[0].goodput_rps == 0:
        raise ImpossibleObjectives(_why_impossible(ranked, workload, rates, objectives))
    return Plan(ranked[0], tuple(ranked))


def _why_impossible(candidates: Iterable[Prediction], workload: Workload, rates: Rates,
                    objectives: Objectives) -> str:
    """The objective no candidate meets even on an idle cluster, with the best the rates allow."""
    candidates = list(candidates)
    fastest = min((min(rates.tensor_parallel[t].decode_step_s.items()), t) for t in rates.sizes("decode"))
    if all(c.bound == "TPOT" for c in candidates):
        (batch, step_s), tp = fastest
        return (f"no layout meets TPOT <= {objectives.tpot_s * 1e3:g} ms: the fastest decode step measured takes "
                f"{step_s * 1e3:.3g} ms (batch {batch}, TP {tp}), before any prefill shares it")
    best = max(candidates, key=lambda c: c.attainment)
    longest = max(c.prompt_tokens[1] for c in workload.classes)
    pace = max(rates.tensor_parallel[t].prefill_tokens_per_s for t in rates.sizes("prefill"))
    return (f"no layout meets TTFT <= {objectives.ttft_s:g} s for {objectives.attainment:.0%} of the requests, even "
            f"idle: at best {best.attainment:.0%} ({best.layout.label}); a {longest}-token prompt takes "
            f"{longest / pace:.3g} s to prefill at the fastest pace measured ({pace:.0f} tokens/s)")
