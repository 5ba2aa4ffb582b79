"""A load generator of the field, guidellm, drives a local cluster's OpenAI-compatible HTTP API
(``python -m bench.openai_load``): its requests succeed and the record has the usual shape."""

from __future__ import annotations

import json

import pytest

from bench import openai_load

pytestmark = pytest.mark.slow


def test_guidellm_drives_the_openai_api_of_a_local_cluster(tmp_path):
    assert openai_load.main(["--seconds", "15", "--streams", "2", "--prompt-tokens", "32", "--output-tokens", "8",
                             "--tag", "test", "--out-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("openai_load-test-*.json")
    record = json.loads(path.read_text())
    assert {"benchmark", "model", "machine", "date", "versions", "workload", "metrics"} <= set(record)
    metrics = record["metrics"]
    assert metrics["requests_successful"] >= 1 and metrics["requests_errored"] == 0
    assert metrics["output_tokens_per_s"] > 0 and metrics["ttft_ms_p50"] > 0
