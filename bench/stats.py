"""The statistics every benchmark reports: quantiles, means and medians, goodput and SLO attainment.

Every script under ``bench/`` takes these numbers from here, so that a ``p99`` or a goodput means
the same in every record. ``mean`` and ``median`` are the standard library's (``statistics.fmean``
and ``statistics.median``); quantiles are NumPy's default (linear interpolation between the
closest ranks, NumPy's ``method="linear"``, the R-7 definition); goodput follows DistServe
(Zhong et al., OSDI 2024): the requests per second that complete within both the
time-to-first-token and the time-per-output-token SLO.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import fmean as mean
from statistics import median

import numpy as np

__all__ = ["goodput_rps", "mean", "median", "percentile", "quantiles", "slo_attainment"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (``q`` in 0..1) of ``values`` by linear interpolation between the
    closest ranks; NaN when ``values`` is empty (a run in which nothing completed)."""
    if not len(values):
        return float("nan")
    return float(np.quantile(values, q))


def quantiles(values: Sequence[float], name: str, percents: Iterable[int] = (50, 90, 99)) -> dict[str, float]:
    """``{name}_p{percent}_s`` for each of ``percents`` (0..100): the latency quantiles of
    ``values`` (seconds) under the names the records use, e.g. ``ttft_p99_s``."""
    return {f"{name}_p{percent}_s": percentile(values, percent / 100) for percent in percents}


def _within(latencies: Iterable[tuple[float, float]], slo: tuple[float, float]) -> int:
    """How many of the ``(ttft, tpot)`` pairs (seconds) meet both bounds of ``slo``."""
    slo_ttft, slo_tpot = slo
    return sum(ttft <= slo_ttft and tpot <= slo_tpot for ttft, tpot in latencies)


def goodput_rps(latencies: Iterable[tuple[float, float]], elapsed_s: float, slo: tuple[float, float]) -> float:
    """Requests per second that completed within both SLOs.

    Args:
        latencies: ``(ttft, tpot)`` in seconds of each request that completed.
        elapsed_s: the run's length, seconds (> 0).
        slo: the ``(ttft, tpot)`` bounds, seconds.
    """
    return _within(latencies, slo) / elapsed_s


def slo_attainment(latencies: Iterable[tuple[float, float]], num_requests: int, slo: tuple[float, float]) -> float:
    """The share of ``num_requests`` (failed ones included) that completed within both SLOs;
    ``latencies`` and ``slo`` as in :func:`goodput_rps`. 0 when there were no requests."""
    return _within(latencies, slo) / max(1, num_requests)
