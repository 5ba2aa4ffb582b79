"""bench/cpu_stream.py at a tiny size (2 prompts, 4 tokens, one round; no gateway, no
llama.cpp: CI does not install the bench-cpu extra): the record's shape and its flat numeric
metrics; and the agreement measure against llama.cpp's tokens."""

from __future__ import annotations

import json
import numbers

import pytest

from bench.cpu_stream import main, prefix_agreement, summarize

pytestmark = pytest.mark.slow


def test_a_tiny_run_writes_one_record_of_numbers(tmp_path) -> None:
    path = main(["--prompts", "2", "--max-tokens", "4", "--rounds", "1", "--skip-gateway", "--skip-llamacpp",
                 "--out-dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and path.name.startswith("cpu_stream-")
    assert {"benchmark", "model", "machine", "date", "versions", "workload", "metrics"} <= record.keys()
    assert record["benchmark"] == "cpu_stream" and record["workload"]["prompts"] == 2
    assert record["workload"]["tandem_quantization"] == "gguf"
    metrics = record["metrics"]
    assert all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in metrics.values()), metrics
    for name in ("tandem", "tandem_none", "transformers"):
        assert metrics[f"{name}_tok_s_one_stream"] > 0 and metrics[f"{name}_tok_s_batch2"] > 0
    assert 0 < metrics["tandem_ttft_s_p50"] < 60
    assert metrics["tandem_over_transformers_one_stream"] > 0
    assert not any(k.startswith(("llamacpp", "gateway")) or "over_llamacpp" in k for k in metrics)
    # The dequantized path and the quantized one agree on 4 greedy tokens of these prompts.
    assert metrics["tandem_none_agreement"] == 1.0 and metrics["tandem_none_exact_matches"] == 2


def test_agreement_is_the_share_before_the_first_disagreement() -> None:
    share, exact = prefix_agreement([[1, 2, 3, 4], [5, 6, 7, 8], [9]], [[1, 2, 0, 4], [5, 6, 7, 8], [0]])
    assert share == pytest.approx((0.5 + 1.0 + 0.0) / 3)  # the 4 after a disagreement does not count
    assert exact == 1


def test_best_of_rounds_is_the_highest_rate_and_the_lowest_ttft_and_ratios_use_them() -> None:
    rounds = [{"tandem_tok_s_one_stream": 100.0, "tandem_ttft_s_p50": 0.2, "llamacpp_tok_s_one_stream": 90.0},
              {"tandem_tok_s_one_stream": 80.0, "tandem_ttft_s_p50": 0.1, "llamacpp_tok_s_one_stream": 120.0}]
    metrics = summarize(rounds, "batch16")
    assert metrics["tandem_tok_s_one_stream"] == 100.0 and metrics["tandem_ttft_s_p50"] == 0.1
    assert metrics["tandem_over_llamacpp_one_stream"] == pytest.approx(100 / 120, abs=1e-4)
    assert "tandem_over_llamacpp_batch16" not in metrics  # no batch figures, no batch ratio


def test_a_gateway_at_another_stream_interval_gets_its_ratio_to_offline() -> None:
    rounds = [{"tandem_tok_s_one_stream": 50.0, "gateway_tok_s_one_stream": 35.0,
               "gateway_interval8_tok_s_one_stream": 40.0, "gateway_interval8_ttft_s_p50": 0.2}]
    metrics = summarize(rounds, "batch16")
    assert metrics["gateway_over_offline_one_stream"] == pytest.approx(0.7)
    assert metrics["gateway_interval8_over_offline_one_stream"] == pytest.approx(0.8)
