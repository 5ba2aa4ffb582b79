"""How much longer a decode worker's streams can be stalled and still meet a time-per-output-token
objective: the budget a prefill on that decode worker spends.

A stream's TPOT is its mean time per output token after the first (DistServe, OSDI'24, §2: the
objective its goodput counts). A prompt prefilled on a decode worker stalls every sequence
running there for about the time its tokens take to compute, chunked or not (the chunks' work
runs between their decode steps): ``n * p_d`` seconds for ``n`` tokens at the worker's prefill
pace ``p_d``. A per-step ITL objective refuses any step longer than itself; a TPOT objective
lets a stream absorb a stall wherever its mean stays within the objective, which is how a
colocated worker's long prefills pass a TPOT SLO while its steps take several times the
objective.

Stream ``i`` on the worker, ``t_i`` seconds after its first token and ``k_i`` tokens past it,
expected to reach ``E_i`` tokens past it, on a worker whose steps take ``s_d`` seconds, meets
objective ``T`` as long as its remaining stalls total at most

    slack_i = T * E_i - t_i - s_d * (E_i - k_i)

A stream's length is known only when it ends (a stop token, the client's cancellation): ``E_i``
is the mean length ``L`` of the streams this gateway has seen end (a moving average), within
``[k_i + 1, N_i]``, ``N_i`` its bound (``max_tokens``, or what ``max_model_len`` leaves, which a
request that sets no ``max_tokens`` is far from reaching). A stream past ``L`` is taken to end
after its next token, which then carries the whole stall: it keeps only the slack it has
earned. A stream whose slack is already negative misses the objective even if nothing stalls
it again, and one whose slack is below the stall of the local prefills already queued on its
worker misses it whatever is decided for the next prompt: refusing a prefill cannot save either,
so neither counts (were they counted, one late stream would send every prompt, the shortest too,
to queue on a prefill worker behind long ones, while the decode worker's other streams could
absorb them). Before any stream has ended, nothing
is predicted. Only the streams this gateway started are seen (another gateway's are not, as for
the prefill queue in :mod:`gateway.placement`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


_SMOOTHING = 0.1  # weight of the newest ended stream's length in the moving average


@dataclass(frozen=True)
class _Stream:
    started: float  # time.monotonic() of its first token
    tokens: Callable[[], int]  # tokens past the first so far
    horizon: int  # tokens past the first at most


class DecodeSlack:
    """The streams this gateway decodes on each decode worker, and their TPOT slack (module
    docstring).

    Attributes:
        expected_tokens: the mean length, in output tokens past the first, of the streams seen
            end (``None``: none yet).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._streams: dict[str, dict[int, _Stream]] = {}
        self._ids = itertools.count()
        self.expected_tokens: float | None = None

    @contextlib.contextmanager
    def decoding(self, worker_id: str, tokens: Callable[[], int], horizon: int) -> Iterator[None]:
        """Count a stream on ``worker_id`` while the block runs, from its first token.

        Args:
            tokens: returns the stream's output tokens past its first so far.
            horizon: output tokens past the first it may reach at most.
        """
        key = next(self._ids)
        streams = self._streams.setdefault(worker_id, {})
        streams[key] = _Stream(self._clock(), tokens, horizon)
        try:
            yield
        finally:
            del streams[key]
            if not streams:
                del self._streams[worker_id]
            length, old = tokens(), self.expected_tokens
            self.expected_tokens = length if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * length

    def count(self, worker_id: str) -> int:
        """Streams this gateway decodes on ``worker_id``."""
        return len(self._streams.get(worker_id, ()))

    def slack_s(self, worker_id: str, tpot_s: float, step_s: float, committed_s: float = 0.0) -> float | None:
        """The least stall, seconds, that one of ``worker_id``'s streams can still absorb and
        keep its mean time per output token within ``tpot_s``, its remaining tokens taking
        ``step_s`` each, over the streams that the stalls already committed there
        (``committed_s``: the local prefills queued ahead of the one asking) leave able to meet it
        (``math.inf`` when none of this gateway's there has tokens left to produce and the
        objective in reach; ``None`` before any stream has ended)."""
        if self.expected_tokens is None:
            return None
        now, least = self._clock(), math.inf
        for stream in self._streams.get(worker_id, {}).values():
            tokens = stream.tokens()
            if tokens >= stream.horizon:
                continue  # done producing: no stall reaches it any more
            expected = min(stream.horizon, max(tokens + 1, self.expected_tokens))
            slack = tpot_s * expected - (now - stream.started) - step_s * (expected - tokens)
            if slack >= committed_s:  # one the committed stalls make miss it is not saved by refusing another
                least = min(least, slack)
        return least
