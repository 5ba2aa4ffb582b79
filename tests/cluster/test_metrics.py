"""A worker's Prometheus page: the engine's step totals as counters, by kind."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import WorkerMetrics
from engine.outputs import EngineStats, StepTotals


def test_step_totals_are_counters_by_role_and_kind():
    totals = {"decode": StepTotals(steps=40, seconds=0.5, tokens=5120), "mixed": StepTotals(3, 0.25, 6100)}
    metrics = WorkerMetrics("decode", lambda: EngineStats(step_totals=totals))
    page = generate_latest(metrics.registry).decode()
    samples = {(s.name, s.labels["kind"]): s.value for family in text_string_to_metric_families(page)
               for s in family.samples if s.name.startswith("tandem_engine_step") and s.labels.get("role") == "decode"}
    assert samples == {
        ("tandem_engine_steps_total", "decode"): 40, ("tandem_engine_steps_total", "mixed"): 3,
        ("tandem_engine_step_seconds_total", "decode"): 0.5, ("tandem_engine_step_seconds_total", "mixed"): 0.25,
        ("tandem_engine_step_tokens_total", "decode"): 5120, ("tandem_engine_step_tokens_total", "mixed"): 6100,
    }
