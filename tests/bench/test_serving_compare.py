"""The disaggregated-vs-colocated comparison: best goodput per setup, their ratio, and a table
and plot rebuilt from the flat record alone."""

from __future__ import annotations

import pytest

from bench.serving_compare import comparison_metrics, markdown_table, plot, runs_of


def run(goodput: float, ttft_p99: float) -> dict[str, float]:
    return {"service_output_tokens_per_s": 100.0, "ttft_p50_s": ttft_p99 / 2, "ttft_p99_s": ttft_p99,
            "tpot_p50_s": 0.02, "tpot_p99_s": 0.03, "goodput_rps": goodput, "slo_attainment": 0.5,
            "requests_per_s": 9.0}


RUNS = {"disagg": {("open", 2.0): run(1.8, 0.4), ("open", 4.0): run(3.0, 0.9), ("open", 8.0): run(2.5, 2.0)},
        "colocated": {("open", 2.0): run(1.5, 0.7), ("open", 4.0): run(1.0, 1.6), ("open", 8.0): run(0.2, 4.0)}}


def test_best_goodput_of_each_setup_and_their_ratio():
    metrics = comparison_metrics(RUNS)
    assert metrics["goodput_rps_disagg"] == 3.0 and metrics["goodput_rps_colocated"] == 1.5
    assert metrics["goodput_ratio"] == 2.0
    assert metrics["colocated_open8_ttft_p99_s"] == 4.0
    assert "disagg_open2_requests_per_s" not in metrics  # only the compared columns are copied


def test_no_ratio_when_colocated_served_nothing_within_the_slos():
    metrics = comparison_metrics({"disagg": RUNS["disagg"], "colocated": {("open", 2.0): run(0.0, 9.0)}})
    assert "goodput_ratio" not in metrics and metrics["goodput_rps_colocated"] == 0.0


def test_runs_are_recovered_from_the_flat_metrics(tmp_path):
    metrics = {**comparison_metrics(RUNS), "p2p_transfer_gbps": 40.0, "p2p_copy_gbps": 60.0}
    recovered = runs_of(metrics)
    assert recovered == {setup: {key: {k: v for k, v in r.items() if k != "requests_per_s"} for key, r in runs.items()}
                         for setup, runs in RUNS.items()}
    record = {"benchmark": "serving_2gpu", "model": "m", "gpu": "G x2", "date": "d", "metrics": metrics,
              "workload": {"name": "long", "slo_ttft_s": 1.0, "slo_tpot_s": 0.04}}
    table = markdown_table(record)
    assert "| disagg | 4 req/s | 100 | 0.45 | 0.9 | 20.0 | 30.0 | 3 | 0.5 |" in table
    assert "KV transfer (p2p): 40.0 GB/s against a plain copy's 60.0 GB/s." in table
    pytest.importorskip("matplotlib")
    assert plot(record, tmp_path / "plot.png") and (tmp_path / "plot.png").stat().st_size > 10_000
