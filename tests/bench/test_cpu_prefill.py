"""bench/cpu_prefill.py at a tiny size (prompts of 8 and 70 tokens, one round, no llama.cpp: CI
does not install the bench-cpu extra), with this checkout as its own baseline (the child-process
engine): the record's shape, its flat numeric metrics and its ratios."""

from __future__ import annotations

import json
import numbers
from pathlib import Path

import pytest

from bench.cpu_prefill import main

pytestmark = pytest.mark.slow


def test_a_tiny_run_against_this_checkout_writes_one_record_of_numbers(tmp_path) -> None:
    root = Path(__file__).resolve().parents[2]
    path = main(["--rounds", "1", "--lengths", "8", "70", "--baseline", str(root), "--skip-llamacpp",
                 "--out-dir", str(tmp_path)])
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and path.name.startswith("cpu_prefill-")
    assert {"benchmark", "model", "machine", "date", "versions", "workload", "metrics"} <= record.keys()
    assert record["workload"]["engines"] == ["tandem", "baseline", "transformers"]
    metrics = record["metrics"]
    assert all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in metrics.values()), metrics
    for name in ("tandem", "baseline", "transformers"):
        assert 0 < metrics[f"{name}_ttft_s_8"] < 60 and 0 < metrics[f"{name}_ttft_s_70"] < 60
    ratio = metrics["baseline_ttft_s_70"] / metrics["tandem_ttft_s_70"]
    assert metrics["tandem_over_baseline_70"] == pytest.approx(ratio, rel=1e-2)
    assert not any("llamacpp" in k for k in metrics)
