"""The benchmarks' one statistics module: quantiles by linear interpolation between ranks,
goodput and SLO attainment counting only requests within both bounds."""

from __future__ import annotations

import math

import pytest

from bench.stats import goodput_rps, percentile, quantiles, slo_attainment


def test_a_quantile_interpolates_between_the_two_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 0.99) == pytest.approx(49.6)  # 40 + 0.96 x 10
    assert percentile([10.0, 20.0, 30.0], 0.0) == 10.0 and percentile([10.0, 20.0, 30.0], 1.0) == 30.0
    assert percentile([7.0], 0.99) == 7.0


def test_a_run_where_nothing_completed_has_no_quantile() -> None:
    assert math.isnan(percentile([], 0.5))


def test_quantiles_carry_the_record_names() -> None:
    assert quantiles([1.0, 2.0, 3.0], "ttft", (50, 99)) == pytest.approx({"ttft_p50_s": 2.0, "ttft_p99_s": 2.98})


def test_goodput_counts_the_requests_within_both_slos_and_attainment_counts_the_failed_too() -> None:
    latencies = [(0.4, 0.010), (0.5, 0.020), (0.6, 0.010), (0.3, 0.050)]  # within, on both bounds, TTFT over, TPOT over
    slo = (0.5, 0.020)
    assert goodput_rps(latencies, elapsed_s=4.0, slo=slo) == 0.5
    assert slo_attainment(latencies, num_requests=8, slo=slo) == 0.25  # 4 more requests failed
    assert slo_attainment([], num_requests=0, slo=slo) == 0.0
