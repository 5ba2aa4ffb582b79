"""The disaggregated / colocated / adaptive comparison: best goodput per setup and SLO pair,
their ratios, the per-run summary (ITL gaps apart from TPOT), and a table and plot rebuilt from
the flat record alone."""

from __future__ import annotations

import pytest

from bench.serving import Result, summarize
from bench.serving_compare import COLUMNS, comparison_metrics, fold_aimed_runs, markdown_table, plot, runs_of, setup_label


def run(goodput: float, ttft_p99: float, relaxed: float | None = None) -> dict[str, float]:
    return {"service_output_tokens_per_s": 100.0, "ttft_p50_s": ttft_p99 / 2, "ttft_p99_s": ttft_p99,
            "tpot_p50_s": 0.02, "tpot_p99_s": 0.03, "goodput_rps": goodput, "slo_attainment": 0.5,
            "requests_per_s": 9.0, "goodput_rps_ttft1s_tpot40ms": goodput if relaxed is None else relaxed}


RUNS = {"disagg": {("open", 2.0): run(1.8, 0.4), ("open", 4.0): run(3.0, 0.9), ("open", 8.0): run(2.5, 2.0)},
        "colocated": {("open", 2.0): run(1.5, 0.7), ("open", 4.0): run(1.0, 1.6), ("open", 8.0): run(0.2, 4.0)}}


def test_best_goodput_of_each_setup_and_their_ratio():
    metrics = comparison_metrics(RUNS)
    assert metrics["goodput_rps_disagg"] == 3.0 and metrics["goodput_rps_colocated"] == 1.5
    assert metrics["goodput_ratio"] == 2.0 and metrics["goodput_ratio_ttft1s_tpot40ms"] == 2.0
    assert metrics["colocated_open8_ttft_p99_s"] == 4.0
    assert "disagg_open2_requests_per_s" not in metrics  # only the compared columns are copied
    assert not any(name.startswith("adaptive") for name in metrics)


def test_adaptive_is_compared_with_each_fixed_setup_and_the_better_one_at_each_slo_pair():
    adaptive = {("open", 2.0): run(1.8, 0.3, relaxed=2.0), ("open", 4.0): run(2.4, 0.8, relaxed=4.5)}
    colocated = {("open", 2.0): run(1.5, 0.7, relaxed=1.9), ("open", 4.0): run(1.0, 1.6, relaxed=6.0)}
    metrics = comparison_metrics({"disagg": RUNS["disagg"], "colocated": colocated, "adaptive": adaptive})
    assert metrics["goodput_rps_adaptive"] == 2.4 and metrics["goodput_rps_adaptive_ttft1s_tpot40ms"] == 4.5
    assert metrics["adaptive_over_colocated"] == 1.6 and metrics["adaptive_over_disagg"] == 0.8
    assert metrics["adaptive_over_best_fixed"] == 0.8  # disagg's 3.0 is the better fixed setup
    assert metrics["adaptive_over_best_fixed_ttft1s_tpot40ms"] == 0.75  # colocated's 6.0 is, at the relaxed pair


def test_adaptive_goodput_at_a_later_slo_pair_comes_from_the_deployment_aiming_at_it():
    slos = [(0.5, 0.02), (1.0, 0.04)]
    aiming_first = {("long", "open", 4.0): (run(2.4, 0.8, relaxed=3.0), ["prompts"])}
    aiming_relaxed = {("long", "open", 4.0): (run(1.0, 0.9, relaxed=5.5) | {"slo_attainment_ttft1s_tpot40ms": 0.9},
                                              ["prompts"])}
    folded = fold_aimed_runs(aiming_first, {1: aiming_relaxed}, slos)
    metrics, requests = folded[("long", "open", 4.0)]
    assert metrics["goodput_rps"] == 2.4 and metrics["ttft_p99_s"] == 0.8  # the main pair's run, as it was
    assert metrics["goodput_rps_ttft1s_tpot40ms"] == 5.5 and metrics["slo_attainment_ttft1s_tpot40ms"] == 0.9
    assert requests == ["prompts"] and aiming_first[("long", "open", 4.0)][0]["goodput_rps_ttft1s_tpot40ms"] == 3.0
    assert setup_label("adaptive", 1, slos) == "adaptive-ttft1s-tpot40ms" and setup_label("adaptive", 0, slos) == "adaptive"


def test_a_run_is_summarized_with_its_token_gaps_apart_from_tpot():
    # One request: first token at 1.0 s, then gaps 0.01, 0.01, 0.28 (a stall), 0.01: its TPOT
    # averages the stall away (0.0775 s), the gaps keep it; the other request failed.
    stalled = Result(sent=0.5, first_token=1.0, last_token=1.31, output_tokens=5, prompt_tokens=8, cached_tokens=0,
                     itls=[0.01, 0.01, 0.28, 0.01])
    failed = Result(sent=0.0, first_token=0.2, last_token=0.2, output_tokens=0, prompt_tokens=8, cached_tokens=0,
                    error="UNAVAILABLE")
    metrics = summarize([stalled, failed], elapsed=2.0, slos=[(0.5, 0.1), (0.4, 0.1), (1.0, 0.05)])
    assert metrics["itl_p50_s"] == pytest.approx(0.01) and metrics["itl_p99_s"] > 0.25
    assert metrics["tpot_p99_s"] == pytest.approx(0.0775)
    assert metrics["goodput_rps"] == 0.5 and metrics["slo_attainment"] == 0.5  # TTFT 0.5 <= 0.5, TPOT within
    assert metrics["goodput_rps_ttft0.4s_tpot100ms"] == 0.0  # TTFT over
    assert metrics["goodput_rps_ttft1s_tpot50ms"] == 0.0  # TPOT over
    assert metrics["failed_requests"] == 1


def test_no_ratio_when_colocated_served_nothing_within_the_slos():
    metrics = comparison_metrics({"disagg": RUNS["disagg"], "colocated": {("open", 2.0): run(0.0, 9.0)}})
    assert "goodput_ratio" not in metrics and metrics["goodput_rps_colocated"] == 0.0


def test_runs_are_recovered_from_the_flat_metrics(tmp_path):
    metrics = {**comparison_metrics(RUNS), "p2p_transfer_gbps": 40.0, "p2p_copy_gbps": 60.0}
    recovered = runs_of(metrics)
    assert recovered == {setup: {key: {k: v for k, v in r.items() if k in COLUMNS} for key, r in runs.items()}
                         for setup, runs in RUNS.items()}
    record = {"benchmark": "serving_2gpu", "model": "m", "gpu": "G x2", "date": "d", "metrics": metrics,
              "workload": {"name": "long", "slos_ttft_tpot_s": [[0.5, 0.02], [1.0, 0.04]]}}
    table = markdown_table(record)
    assert "| disagg | 4 req/s | 100 | 0.45 | 0.9 | 20.0 | 30.0 | 3 | 0.5 |" in table
    assert "at TTFT ≤ 1 s, TPOT ≤ 40 ms: disagg 3.000 req/s, colocated 1.500 req/s (goodput_ratio 2.00)." in table
    assert "KV transfer (p2p): 40.0 GB/s against a plain copy's 60.0 GB/s." in table
    pytest.importorskip("matplotlib")
    assert plot(record, tmp_path / "plot.png") and (tmp_path / "plot.png").stat().st_size > 10_000
