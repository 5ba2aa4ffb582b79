"""A worker's Prometheus page: the engine's step totals as counters, by kind."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import WorkerMetrics
from engine.outputs import EngineStats, SpecDecodingStats, StepTotals


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


def test_speculative_decoding_counts_are_counters_by_position():
    spec = SpecDecodingStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=18,
                             num_drafts_per_position=(10, 10, 10), num_accepted_per_position=(9, 6, 3))
    metrics = WorkerMetrics("decode", lambda: EngineStats(spec_decoding=spec))
    page = generate_latest(metrics.registry).decode()
    samples = {(s.name, s.labels.get("position")): s.value for family in text_string_to_metric_families(page)
               for s in family.samples if s.name.startswith("tandem_spec_decode") and s.name.endswith("_total")}
    assert samples == {
        ("tandem_spec_decode_drafts_total", None): 10, ("tandem_spec_decode_draft_tokens_total", None): 30,
        ("tandem_spec_decode_accepted_tokens_total", None): 18,
        **{("tandem_spec_decode_accepted_tokens_per_pos_total", str(i)): v for i, v in enumerate((9, 6, 3))},
    }
    plain = generate_latest(WorkerMetrics("decode", lambda: EngineStats()).registry).decode()
    assert "tandem_spec_decode" not in plain
