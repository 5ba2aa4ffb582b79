"""How long a prefill may take: the per-hop timeout grows with the work asked for.

A constant timeout cannot fit both a 10-token prompt and the longest one the pool advertises
(8191 tokens took 137 s on a CPU worker: a 60 s timeout failed it twice, each time counting
against the worker). :class:`PrefillPace` keeps, per worker, a moving average of the seconds
each prompt token took to prefill, measured by the gateway on the calls it makes (over the
call's own tokens and the ones the gateway had queued on the worker ahead of it), and gives a
call ``hop_timeout_s`` plus its tokens and the ones queued ahead at ``margin`` times that pace
(before the first measurement: ``default_s_per_token``). The same pace predicts where a
prompt is best prefilled (:mod:`gateway.placement`).
"""

from __future__ import annotations

_SMOOTHING = 0.3  # weight of the newest measurement in the moving average


class PrefillPace:
    """Measured prefill pace per worker, and the timeouts it implies.

    Args:
        base_s: seconds every call gets whatever its size (``hop_timeout_s``): the fixed costs.
        default_s_per_token: seconds per prompt token before a worker has been measured.
        margin: the measured pace is multiplied by this (queueing behind other prefills, and
            attention's cost grows with the prompt: a long prompt is slower per token).
    """

    def __init__(self, base_s: float, default_s_per_token: float, margin: float = 4.0) -> None:
        self.base_s = base_s
        self.default_s_per_token = default_s_per_token
        self.margin = margin
        self._s_per_token: dict[str, float] = {}

    def observe(self, worker_id: str, tokens: int, seconds: float) -> None:
        """Record that ``worker_id`` prefilled ``tokens`` new prompt tokens in ``seconds``
        (calls that computed nothing, a full prefix hit, are not a measurement)."""
        if tokens <= 0:
            return
        pace = seconds / tokens
        old = self._s_per_token.get(worker_id)
        self._s_per_token[worker_id] = pace if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * pace

    def s_per_token(self, worker_id: str) -> float | None:
        """``worker_id``'s measured seconds per prompt token (``None``: not measured yet)."""
        return self._s_per_token.get(worker_id)

    def timeout_s(self, worker_id: str, tokens: int) -> float:
        """Seconds a prefill of ``tokens`` prompt tokens on ``worker_id`` may take."""
        pace = self._s_per_token.get(worker_id)
        per_token = self.default_s_per_token if pace is None else self.margin * pace
        return self.base_s + tokens * per_token
