"""The serving benchmark's account of where a run's time went: the engines' steps and the
gateway's placements and predictions, each between two readings of their counters."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.serving import gateway_counts, gateway_metrics, step_metrics
from engine.outputs import StepTotals
from gateway import metrics as gateway


def test_a_runs_steps_are_the_difference_of_two_readings():
    before = {"decode": StepTotals(100, 1.0, 100), "prefill": StepTotals(2, 0.5, 4000)}
    after = {"decode": StepTotals(300, 3.5, 300), "prefill": StepTotals(2, 0.5, 4000), "mixed": StepTotals(4, 0.2, 900)}
    metrics = step_metrics("service_decode", before, after, engine_seconds=2 * 2.0)  # two workers, 2 s
    assert metrics == pytest.approx({
        "service_decode_decode_steps": 200, "service_decode_decode_step_ms": 12.5,
        "service_decode_mixed_steps": 4, "service_decode_mixed_step_ms": 50.0,
        "service_decode_prefill_steps": 0, "service_decode_prefill_step_ms": 0.0,
        "service_decode_engine_busy_fraction": (2.5 + 0.2) / 4.0,
    })


def test_a_runs_placements_and_prediction_errors_are_the_difference_of_two_readings_of_the_gateway():
    """Read from the gateway's own metrics, as its ``/metrics`` page shows them."""
    def reading():
        page = generate_latest(REGISTRY).decode()
        return gateway_counts(s for family in text_string_to_metric_families(page) for s in family.samples)

    before = reading()
    gateway.PLACEMENTS.labels("remote").inc(3)
    gateway.PLACEMENTS.labels("local_short").inc()
    for ratio in (0.9, 1.1, 1.5, 3.0):  # measured over predicted: two within 1.25x, one over 2x
        gateway.PREFILL_PREDICTION.observe(ratio)
    metrics = gateway_metrics(before, reading())
    assert metrics["placements_remote"] == 3 and metrics["placements_local_short"] == 1
    assert metrics["placements_local_predicted"] == 0
    assert metrics["prefill_predictions"] == 4
    assert metrics["prefill_prediction_ratio_mean"] == pytest.approx(6.5 / 4)
    assert metrics["prefill_prediction_over_1.25x_fraction"] == 0.5
    assert metrics["prefill_prediction_over_2x_fraction"] == 0.25
    assert gateway_metrics(before, before)["prefill_prediction_ratio_mean"] == 0.0
