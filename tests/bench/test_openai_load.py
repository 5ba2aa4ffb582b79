"""A load generator of the field, guidellm, drives a local cluster's OpenAI-compatible HTTP API
(``python -m bench.openai_load``): its requests succeed and the record has the usual shape; a
stalled guidellm is bounded and killed with its workers."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from bench import openai_load


@pytest.mark.slow
def test_guidellm_drives_the_openai_api_of_a_local_cluster(tmp_path):
    assert openai_load.main(["--seconds", "15", "--streams", "2", "--prompt-tokens", "32", "--output-tokens", "8",
                             "--tag", "test", "--out-dir", str(tmp_path)]) == 0
    [path] = tmp_path.glob("openai_load-test-*.json")
    record = json.loads(path.read_text())
    assert {"benchmark", "model", "machine", "date", "versions", "workload", "metrics"} <= set(record)
    metrics = record["metrics"]
    assert metrics["requests_successful"] >= 1 and metrics["requests_errored"] == 0
    assert metrics["output_tokens_per_s"] > 0 and metrics["ttft_ms_p50"] > 0


def test_a_run_past_its_bound_is_killed_with_the_processes_it_spawned(tmp_path):
    pid_file = tmp_path / "child.pid"
    spawner = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
               "'import time; time.sleep(120)']); open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(120)")
    started = time.monotonic()
    assert openai_load._run_bounded([sys.executable, "-c", spawner, str(pid_file)], within_s=3) is False
    assert time.monotonic() - started < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_cluster_that_does_not_answer_after_a_stall_is_the_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once closed
    with pytest.raises(RuntimeError, match="did not answer"):
        openai_load._probe(f"http://127.0.0.1:{port}", "m", timeout_s=5)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a reaped or zombie child counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
