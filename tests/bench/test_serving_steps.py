"""The serving benchmark's account of where a run's time went: the engines' steps between two
readings of their counters."""

from __future__ import annotations

import pytest

from bench.serving import step_metrics
from engine.outputs import StepTotals


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
