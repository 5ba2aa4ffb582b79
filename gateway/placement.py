"""Where a request's prompt is prefilled: on a prefill worker (its KV then moves to the decode
worker), on the decode worker itself, or on another decode worker lent to the prefill (its KV
then moves as a prefill worker's does), chosen per request against service-level objectives.

Disaggregation exists to keep time to first token (TTFT) and inter-token latency (ITL) inside
their SLOs under load (DistServe, OSDI'24, "goodput"); a fixed split loses whenever the prefill
side is the bottleneck while the decode side idles. Dynamo's conditional disaggregation decides
by two static thresholds (prompt length, prefill queue size). Here the decision comes from a
prediction, from state this gateway measures on the calls it makes:

- a worker's prefill pace ``p_w``, seconds per prompt token (:class:`PrefillPace`: a prefill
  worker's Prefill calls, a decode worker's local prefills, each over its own tokens and the
  ones queued ahead of it; a decode worker's net of the steps its local prefills rode, below,
  kept apart from the gross pace the prefill timeouts use);
- the prompt tokens this gateway sent each worker to prefill and has not seen done, ``q_w``
  (another gateway's are not seen: with several gateways the queue is underestimated);
- a decode worker's step time ``s_d``, a moving average of its streams' time per output token.

A decode worker whose pace is not measured yet (only its own local prefills measure it, and a
workload of long prompts starts none) is taken to prefill at the prefill worker's pace (the
same model; its first local prefill measures its own).

TTFT if ``w`` prefills ``n_w`` tokens (the prompt's tokens it does not hold in its prefix
cache): ``(q_w + n_w) * p_w``. A local prefill of ``n`` tokens on a decode worker that runs
sequences rides its steps: the engine computes it in chunks of at most ``c_d`` tokens a step
(the step's token budget the decode worker publishes, ``max_num_batched_tokens``; the whole
prompt where it publishes none), so its running sequences' ITL is ``s_d + min(n, c_d) * p_d``
for ``ceil(n / c_d)`` steps, and it stalls them by ``(q_d + n) * p_d`` in all (the local
prefills queued ahead of it included), which a TPOT objective lets them absorb while each
stream's slack lasts (:mod:`gateway.decode_slack`: a stream whose slack the ``q_d * p_d``
queued ahead already spends is not saved by refusing, and does not count; ``s_d`` the
remaining tokens' step time there, a decode worker with no ``s_d`` measured yet is not
predicted). Its local TTFT adds the steps it rides, the one running as it arrives (half of it
on average) and ``ceil((q_d + n) / c_d)`` more: ``(q_d + n) * p_d + (ceil((q_d + n) / c_d) + 1/2) * s_d``
(:attr:`Placement.ride_s`). So ``p_d`` is the marginal cost of a prompt token in a decode step,
measured net of the ride (a short local prompt's TTFT is mostly the steps it waited for). The
price is linear in tokens where a step that carries a chunk also costs a fixed part more (its
launches; mixed steps replay piecewise CUDA graphs, :mod:`engine.runner.piecewise_graphs`, which keep
that part small); the pace measured on short local prefills carries it.

The decision (:attr:`Placement.kind`, the ``tandem_gateway_placements`` metric's label):

- ``local_only``: no prefill worker can take the request.
- ``local_shared``: in adaptive placement, the prefill worker shares a GPU with the decode worker
  (their published ``device_ids``): its prefill would take the decode worker's GPU time as a
  local one does (two processes time-slice one GPU), and add a KV transfer; only one of the two
  engines should compute on a GPU at a time (docs/benchmarks.md has one GPU served both ways).
- ``local_short``: at most ``local_prefill_max_tokens`` tokens left after the decode worker's
  prefix hit: a static override, Dynamo's threshold (a KV transfer costs more than it saves),
  except in adaptive placement when the decode worker runs sequences and the prefill is
  predicted to break their ITL or TPOT objective while the prefill worker is predicted to meet
  the request's TTFT objective. Where the prefill worker would miss it, the short prompt stays
  local: refusing trades a predicted miss of the running sequences for a certain one of the
  request's, and past the prefill worker's saturation the short prompts of a decode-heavy load
  would queue behind the long ones.
- ``local_predicted``: the local prefill is *safe* for the decode worker's running sequences
  (it runs none, or it is predicted to meet each of the ITL and TPOT objectives set; with
  neither only an idle decode worker is borrowed) and either (with a TTFT SLO) the remote
  prediction misses the SLO and the local one meets it or is lower, or the remote prediction
  spends more than half the SLO (``_TTFT_HEADROOM``) and the local TTFT is below ``local_gain``
  of it, or (without one) the local TTFT is below ``local_gain`` of the remote one. The second
  moves a prompt off the prefill worker's queue, which later requests wait behind, before that
  queue reaches the objective.
- ``lent``: in adaptive placement, another decode worker that serves prefill (its published
  ``serves_prefill``; routing offers the least loaded one, :class:`Lender`) prefills the prompt
  and sends its KV to the request's decode worker, as a prefill worker would: the prefill that
  only the prefill pool could take otherwise gets every GPU of the pool. The lender is predicted
  as a local prefill is, on its own state: ``(q_l + n_l) * p_l`` plus the steps of its own
  sequences it rides, and it is taken only where it is *safe* for those sequences (it runs none,
  or it is predicted to meet each ITL and TPOT objective set; with neither, only an idle one),
  never in a static split. Where the prefill worker is usable, the lender competes with the
  decode worker itself by the ``local_predicted`` rule against the remote prediction, and where
  both pass, it is taken only when its TTFT is below ``local_gain`` of the local one (a KV
  transfer, and the decode worker's own steps spared, against a near-equal prediction). Where no
  prefill worker is usable (none, or only one on the decode worker's GPU) and more than
  ``local_prefill_max_tokens`` are left, it is taken when the local prefill is predicted to break
  the decode worker's objectives, or by the ``local_predicted`` rule against the local
  prediction. Its pace, unmeasured, is taken to be the prefill worker's, else the decode
  worker's own.
- ``remote``: otherwise, whenever the prefill worker's pace is not measured yet, and always with
  ``adaptive`` off (``TANDEM_PREFILL_PLACEMENT=static``: a fixed split, the overrides above
  aside).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from gateway.decode_slack import DecodeSlack
from gateway.prefill_pace import PrefillPace

_SMOOTHING = 0.3  # weight of the newest step time in a decode worker's moving average
# A remote prefill predicted to take more than this fraction of the TTFT objective is at risk of
# missing it (the prediction counts this gateway's queue only, and a prompt's pace varies): a
# decode worker predicted clearly sooner takes it (module docstring, ``local_predicted``).
_TTFT_HEADROOM = 0.5

PLACEMENT_KINDS = LOCAL_ONLY, LOCAL_SHARED, LOCAL_SHORT, LOCAL_PREDICTED, LENT, REMOTE = (
    "local_only", "local_shared", "local_short", "local_predicted", "lent", "remote")


@dataclass(frozen=True)
class ServiceLevel:
    """A request's latency objectives, seconds; ``0``: none.

    Attributes:
        ttft_s: time to first token at most.
        itl_s: inter-token latency at most, every step (of the decode worker's running
            sequences too).
        tpot_s: time per output token after the first at most, the mean over a stream (of the
            decode worker's running sequences too: :mod:`gateway.decode_slack`).
    """

    ttft_s: float = 0.0
    itl_s: float = 0.0
    tpot_s: float = 0.0

    def or_defaults(self, defaults: ServiceLevel) -> ServiceLevel:
        """This objective where set, ``defaults``' elsewhere."""
        return ServiceLevel(self.ttft_s or defaults.ttft_s, self.itl_s or defaults.itl_s,
                            self.tpot_s or defaults.tpot_s)


@dataclass(frozen=True)
class Placement:
    """Where one request's prompt is prefilled, and what was predicted.

    Attributes:
        kind: ``local_only``, ``local_shared``, ``local_short``, ``local_predicted``, ``lent`` or
            ``remote`` (module docstring).
        predicted_ttft_s: the chosen worker's predicted prefill time, seconds (``None``: its
            pace is not measured yet).
        ride_s: of a prefill's time on a decode worker (local or lent), seconds, that worker's
            own steps it is predicted to ride (module docstring; in ``predicted_ttft_s``); ``0``
            for a remote one and where nothing runs there.
    """

    kind: str
    predicted_ttft_s: float | None = None
    ride_s: float = 0.0

    @property
    def local(self) -> bool:
        """The decode worker prefills the prompt itself."""
        return self.kind not in (REMOTE, LENT)

    @property
    def on_decode_worker(self) -> bool:
        """A decode worker prefills the prompt (the request's own, or a lent one): the prefill
        rides its steps."""
        return self.kind != REMOTE


@dataclass(frozen=True)
class Lender:
    """A decode worker, not the request's, that serves prefill and could prefill its prompt.

    Attributes:
        worker_id: its id.
        tokens: prompt tokens it would compute (not in its prefix cache).
        running: sequences it runs (as it last reported).
        step_tokens: its step token budget, its prefill chunk (``0``: unknown).
    """

    worker_id: str
    tokens: int
    running: int
    step_tokens: int = 0


@dataclass(frozen=True)
class _Borrowed:
    """A prefill predicted on a decode worker: its TTFT (``None``: not predictable), the steps it
    rides, and whether it keeps that worker's sequences within their objectives (``_keeps``)."""

    ttft_s: float | None
    ride_s: float
    keeps: bool | None

    @property
    def safe(self) -> bool:
        return self.ttft_s is not None and bool(self.keeps)


class PlacementModel:
    """Per-request placement of the prefill (module docstring), and the state it predicts from.

    Args:
        pace: the measured prefill pace per worker, over a call's whole time (shared with the
            prefill timeouts); a prefill worker's predictions use it.
        local_prefill_max_tokens: at most this many tokens left after the decode worker's
            prefix hit: always prefilled there.
        local_gain: a local prefill is chosen for a shorter prediction only when its predicted
            TTFT is below this fraction of the remote one (so near-equal predictions stay
            disaggregated), unless the remote one misses a TTFT SLO.
        adaptive: decide by prediction (``local_predicted``); ``False``: only the overrides place
            a prefill on the decode worker.

    Attributes:
        local_pace: each decode worker's pace on its local prefills net of the decode steps they
            rode (module docstring); its predictions use it.
        slack: the streams this gateway decodes on each decode worker (the orchestrator counts
            each from its first token to its end), for the TPOT objective.

    Raises:
        ValueError: ``local_prefill_max_tokens`` < 0 or ``local_gain`` outside ``(0, 1]``.
    """

    def __init__(self, pace: PrefillPace, local_prefill_max_tokens: int, *, adaptive: bool,
                 local_gain: float = 0.8) -> None:
        if local_prefill_max_tokens < 0 or not 0 < local_gain <= 1:
            raise ValueError(f"local_prefill_max_tokens={local_prefill_max_tokens} must be >= 0 and "
                             f"local_gain={local_gain} in (0, 1]")
        self.pace = pace
        self.local_pace = PrefillPace(pace.base_s, pace.default_s_per_token)  # its timeouts unused
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.local_gain = local_gain
        self.adaptive = adaptive
        self._queued: Counter[str] = Counter()
        self._step_s: dict[str, float] = {}
        self.slack = DecodeSlack()

    def decide(self, remote_worker: str | None, remote_tokens: int, decode_worker: str, local_tokens: int,
               decode_running: int, slo: ServiceLevel, decode_step_tokens: int = 0,
               shared_device: bool = False, lender: Lender | None = None) -> Placement:
        """Place one prefill.

        Args:
            remote_worker: the prefill worker routing chose (``None``: none can take it).
            remote_tokens: prompt tokens it would compute (not in its prefix cache).
            decode_worker: the decode worker routing chose.
            local_tokens: prompt tokens the decode worker would compute (not in its prefix cache).
            decode_running: sequences the decode worker runs (as it last reported).
            slo: the request's objectives.
            decode_step_tokens: the decode worker's step token budget, its prefill chunk
                (``0``: unknown, the whole prompt is taken as one step's work).
            shared_device: the prefill worker runs on a GPU the decode worker runs on.
            lender: another decode worker routing offers to prefill the prompt (``None``: none).
        """
        prior = self.pace.s_per_token(remote_worker) if remote_worker is not None else None
        local = self._borrowed(decode_worker, local_tokens, decode_running, decode_step_tokens, slo, prior)
        if remote_worker is None or (self.adaptive and shared_device):
            lent = self._lent(lender, slo, prior or self.local_pace.s_per_token(decode_worker)) \
                if local_tokens > self.local_prefill_max_tokens else None
            if lent is not None and (local.keeps is False or self._sooner(lent.ttft_s, local.ttft_s, slo)):
                return Placement(LENT, lent.ttft_s, lent.ride_s)
            return Placement(LOCAL_ONLY if remote_worker is None else LOCAL_SHARED, local.ttft_s, local.ride_s)
        keeps = local.keeps if self.adaptive else None
        remote_ttft = self.predict_ttft(remote_worker, remote_tokens)
        if local_tokens <= self.local_prefill_max_tokens and (
                keeps is not False or self._only_local_meets_ttft(slo, local.ttft_s, remote_ttft)):
            return Placement(LOCAL_SHORT, local.ttft_s, local.ride_s)
        if not self.adaptive or remote_ttft is None:
            return Placement(REMOTE, remote_ttft)
        lent = self._lent(lender, slo, prior)
        sooner_local = local.safe and self._sooner(local.ttft_s, remote_ttft, slo)
        if lent is not None and self._sooner(lent.ttft_s, remote_ttft, slo) and (
                not sooner_local or lent.ttft_s < self.local_gain * local.ttft_s):
            return Placement(LENT, lent.ttft_s, lent.ride_s)
        if sooner_local:
            return Placement(LOCAL_PREDICTED, local.ttft_s, local.ride_s)
        return Placement(REMOTE, remote_ttft)

    def _borrowed(self, worker_id: str, tokens: int, running: int, step_tokens: int, slo: ServiceLevel,
                  prior: float | None) -> _Borrowed:
        """A prefill of ``tokens`` on decode worker ``worker_id`` running ``running`` sequences,
        at its net pace (``prior`` until it is measured): its prediction (module docstring)."""
        pace = self.local_pace.s_per_token(worker_id)
        pace = prior if pace is None else pace
        # The running sequences' steps wait while the prefills there, this one last, compute:
        # the stall they absorb is their tokens' time; the prefill waits for their steps too.
        stall = self._ttft(worker_id, tokens, pace)
        ride_s = self._ride_s(worker_id, tokens, running, step_tokens)
        chunk = min(tokens, step_tokens) if step_tokens > 0 else tokens
        keeps = self._keeps(worker_id, running, slo, self._itl(worker_id, chunk, pace), stall,
                            self._ttft(worker_id, 0, pace))
        return _Borrowed(None if stall is None else stall + ride_s, ride_s, keeps)

    def _lent(self, lender: Lender | None, slo: ServiceLevel, prior: float | None) -> _Borrowed | None:
        """``lender``'s prediction where adaptive placement may take it: predicted, and safe for
        its own sequences (``None`` otherwise)."""
        if lender is None or not self.adaptive:
            return None
        lent = self._borrowed(lender.worker_id, lender.tokens, lender.running, lender.step_tokens, slo, prior)
        return lent if lent.safe else None

    def _sooner(self, ttft_s: float | None, reference_s: float | None, slo: ServiceLevel) -> bool:
        """Whether a borrowed decode worker's predicted ``ttft_s`` beats ``reference_s`` (the
        remote prediction, or the local one where no prefill worker is usable) by the
        ``local_predicted`` rule (module docstring)."""
        if ttft_s is None or reference_s is None:
            return ttft_s is not None
        if slo.ttft_s:
            return reference_s > slo.ttft_s and (ttft_s <= slo.ttft_s or ttft_s < reference_s) \
                or reference_s > _TTFT_HEADROOM * slo.ttft_s and ttft_s < self.local_gain * reference_s
        return ttft_s < self.local_gain * reference_s

    @staticmethod
    def _only_local_meets_ttft(slo: ServiceLevel, local_ttft: float | None, remote_ttft: float | None) -> bool:
        """Whether the prefill worker is predicted to miss ``slo``'s TTFT objective where the
        decode worker meets it."""
        return bool(slo.ttft_s) and local_ttft is not None and remote_ttft is not None \
            and local_ttft <= slo.ttft_s < remote_ttft

    def predict_ttft(self, worker_id: str, tokens: int) -> float | None:
        """Seconds until ``worker_id`` has prefilled ``tokens`` more prompt tokens behind the
        ones this gateway already sent it (``None``: its pace is not measured yet)."""
        return self._ttft(worker_id, tokens, self.pace.s_per_token(worker_id))

    def predict_itl(self, decode_worker: str, tokens: int) -> float | None:
        """The decode worker's step time, seconds, while a step of it also prefills ``tokens``
        prompt tokens (``None``: its pace is not measured yet)."""
        return self._itl(decode_worker, tokens, self.local_pace.s_per_token(decode_worker))

    def _ttft(self, worker_id: str, tokens: int, pace: float | None) -> float | None:
        return None if pace is None else (self.queued(worker_id) + tokens) * pace

    def _ride_s(self, decode_worker: str, tokens: int, running: int, step_tokens: int) -> float:
        """Seconds of ``decode_worker``'s own steps a local prefill of ``tokens`` more prompt
        tokens waits through while its ``running`` sequences decode (module docstring)."""
        step_s = self._step_s.get(decode_worker, 0.0)
        if not running or not step_s:
            return 0.0
        queued = self.queued(decode_worker) + tokens
        return (math.ceil(queued / step_tokens) if step_tokens > 0 else 1) * step_s + step_s / 2

    def _itl(self, decode_worker: str, tokens: int, pace: float | None) -> float | None:
        return None if pace is None else self._step_s.get(decode_worker, 0.0) + tokens * pace

    def _keeps(self, decode_worker: str, running: int, slo: ServiceLevel, itl: float | None,
               stall: float | None, committed: float | None) -> bool | None:
        """Whether a local prefill whose steps are predicted to last ``itl`` and which delays
        the decode worker's ``running`` sequences by ``stall`` seconds in all, ``committed`` of
        them the local prefills queued ahead of it, keeps them within ``slo``'s ITL and TPOT
        objectives: ``True`` (it runs none, or every objective set is predicted met), ``False``
        (one is predicted broken), ``None`` (neither objective is set, or one cannot be
        predicted yet)."""
        if running == 0:
            return True
        met = []
        if slo.itl_s:
            met.append(None if itl is None else itl <= slo.itl_s)
        if slo.tpot_s:
            step_s = self._step_s.get(decode_worker)
            slack = None if step_s is None or not self.slack.count(decode_worker) \
                else self.slack.slack_s(decode_worker, slo.tpot_s, step_s, committed or 0.0)  # None: none ended
            met.append(None if slack is None or stall is None else stall <= slack)
        if False in met:
            return False
        return None if not met or None in met else True

    def queued(self, worker_id: str) -> int:
        """Prompt tokens this gateway sent ``worker_id`` to prefill and has not seen done."""
        return self._queued[worker_id]

    def started(self, worker_id: str, tokens: int) -> None:
        """``worker_id`` was sent ``tokens`` prompt tokens to prefill (call :meth:`ended` once)."""
        self._queued[worker_id] += tokens

    def ended(self, worker_id: str, tokens: int) -> None:
        """The prefill :meth:`started` with these arguments ended (done, failed or cancelled)."""
        self._queued[worker_id] -= tokens
        if self._queued[worker_id] <= 0:
            del self._queued[worker_id]

    def observe_prefill(self, worker_id: str, tokens: int, seconds: float, placement: Placement) -> None:
        """``worker_id`` computed ``tokens`` prompt tokens (the ones queued ahead included) in
        ``seconds`` for a prefill placed by ``placement``: its pace (:attr:`pace`, what the
        timeouts allow) and, for a prefill on a decode worker (local or lent), its pace net of
        the decode steps it was predicted to ride (:attr:`local_pace`, module docstring)."""
        self.pace.observe(worker_id, tokens, seconds)
        if placement.on_decode_worker:
            self.local_pace.observe(worker_id, tokens, max(0.0, seconds - placement.ride_s))

    def observe_step(self, decode_worker: str, seconds: float) -> None:
        """A stream on ``decode_worker`` took ``seconds`` per output token after its first."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        old = self._step_s.get(decode_worker)
        self._step_s[decode_worker] = seconds if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * seconds
