"""``python -m prefill_worker`` / ``python -m decode_worker`` as processes, the way the launcher
runs them: configured by flags and TANDEM_* variables, a ``listening on`` line, gRPC health
SERVING (on the plaintext probe port too, as Kubernetes asks), and a clean exit 0 on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import socket
import time
import urllib.request

import grpc
import pytest

from cli.launcher import free_port
from cluster.health import LIVENESS
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("module", ["prefill_worker", "decode_worker"])
def test_worker_process_serves_and_exits_cleanly_on_sigterm(module):
    metrics_port, health_port = free_port(), free_port()
    env = {**os.environ, "TANDEM_NUM_BLOCKS": "8", "TANDEM_REDIS_URL": "", "TANDEM_LOG_LEVEL": "INFO",
           "TANDEM_HEALTH_PORT": str(health_port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--listen", "127.0.0.1:0", "--model", "smollm2-135m",
         "--load-format", "dummy", "--block-size", "16", "--metrics-port", str(metrics_port), "--insecure"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        address, deadline, lines = None, time.monotonic() + 60, []
        while address is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, f"worker exited early: {''.join(lines)}"
            lines.append(line)
            if m := re.search(r"listening on (\S+)", line):
                address = m.group(1)
        assert address, "no 'listening on' line"
        assert any("insecure" in line and "plaintext" in line for line in lines), lines  # plaintext is loud
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub_cls = worker_pb2_grpc.PrefillWorkerStub if module == "prefill_worker" else worker_pb2_grpc.DecodeWorkerStub
            stats = stub_cls(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5)
            assert (stats.num_total_blocks, stats.config.block_size) == (8, 16)
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            probe = health_pb2_grpc.HealthStub(channel)
            for service in ("", LIVENESS):
                assert probe.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING, service
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        assert 'tandem_kv_blocks_free{role="' in text and "tandem_time_to_first_token_seconds" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_a_taken_port_is_one_line_naming_the_address_and_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, setting in ((["--listen", f"127.0.0.1:{port}"], "--listen / TANDEM_LISTEN"),
                               (["--metrics-port", str(port)], "--metrics-port / TANDEM_METRICS_PORT"),
                               (["--health-port", str(port)], "--health-port / TANDEM_HEALTH_PORT")):
            out = subprocess.run(
                [sys.executable, "-m", "decode_worker", "--model", "smollm2-135m", "--load-format", "dummy",
                 "--num-blocks", "8", "--log-level", "WARNING", *flags],
                env={**os.environ, "TANDEM_REDIS_URL": "", "TANDEM_INSECURE": "1"}, capture_output=True, text=True,
                timeout=120)
            assert out.returncode == 1, out.stderr
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and setting in lines[0], out.stderr


@pytest.mark.parametrize("module", ["prefill_worker", "decode_worker", "gateway"])
def test_a_server_without_tls_refuses_to_start_unless_plaintext_is_chosen(module):
    """No ``tls_dir`` and no ``insecure``: one line naming both settings, exit code 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_TLS_DIR", "TANDEM_INSECURE")}
    out = subprocess.run(
        [sys.executable, "-m", module, "--listen", "127.0.0.1:0", "--model", "smollm2-135m", "--log-level", "ERROR",
         *(["--load-format", "dummy", "--num-blocks", "8"] if module != "gateway" else [])],
        env={**env, "TANDEM_REDIS_URL": ""}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--tls-dir / TANDEM_TLS_DIR" in lines[0] and "--insecure / TANDEM_INSECURE" in lines[0], \
        out.stderr
