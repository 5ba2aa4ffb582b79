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
import threading
import time
import urllib.request

import grpc
import pytest

from cli.launcher import free_port
from cluster.health import LIVENESS
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc

from protos.tandem.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

from tests.helpers.models import save_tiny_llama

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


def _children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (``/proc/<child>/stat``'s fourth field)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_decode_worker(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A decode worker process on a free port; returns it once it listens, and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "decode_worker", "--listen", "127.0.0.1:0", "--block-size", "16", "--insecure",
         "--metrics-port", "0", *flags],
        env={**os.environ, "TANDEM_REDIS_URL": "", "TANDEM_LOG_LEVEL": "INFO", **(env or {})},
        stderr=subprocess.PIPE, text=True)
    deadline, lines = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, f"worker exited early: {''.join(lines)}"
        lines.append(line)
        if m := re.search(r"listening on (\S+)", line):
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # keep its pipe drained
            return proc, m.group(1)
    raise AssertionError(f"no 'listening on' line: {''.join(lines)}")


@pytest.mark.slow
def test_a_killed_worker_leaves_no_process_behind(tmp_path):
    """SIGKILL a decode worker whose engine core runs two tensor-parallel ranks: its engine core
    (its child) and the rank the core started (a grandchild) exit on their own within seconds."""
    model = save_tiny_llama(tmp_path / "tiny-llama")
    proc, _ = _start_decode_worker("--model", model, "--num-blocks", "16", "--tensor-parallel-size", "2",
                                   "--device", "cpu")
    try:
        family = _descendants(proc.pid)
        assert len(family) >= 2, family  # the engine core and the other rank
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in family if _alive(pid)], "processes outlived their worker"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _decode_stream(address: str, max_tokens: int) -> grpc.Future:
    """Admit a prompt and decode it with a local prefill; returns the stream's call."""
    channel = grpc.insecure_channel(address)
    stub = worker_pb2_grpc.DecodeWorkerStub(channel)
    prompt = list(range(100, 140))
    admit = stub.Admit(worker_pb2.AdmitRequest(request_id="r", prompt_token_ids=prompt), timeout=30)
    return stub.Decode(worker_pb2.DecodeRequest(
        request_id="r", reservation_id=admit.reservation_id, prompt_token_ids=prompt, local_prefill=True,
        sampling=gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_an_engine_core_that_dies_or_hangs_fails_its_streams_and_stops_its_worker(fault):
    """The engine core killed (SIGKILL) or frozen (SIGSTOP: its loop sends nothing more, as a hung
    step would): the stream in flight ends UNAVAILABLE (the gateway retries or resumes it
    elsewhere), and the worker exits with status 1, leaving no process behind."""
    # (Long enough for any real step of this engine on a busy machine.)
    proc, address = _start_decode_worker("--model", "smollm2-135m", "--load-format", "dummy", "--num-blocks", "32",
                                         env={"TANDEM_ENGINE_HANG_TIMEOUT_S": "10"})
    try:
        (core,) = _children(proc.pid)
        stream = _decode_stream(address, max_tokens=400)
        received = 0
        while received < 3:  # decoding: every step from now on is a short one
            received += len(next(stream).token_ids)
        os.kill(core, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert proc.wait(timeout=60) == 1
        time.sleep(1.0)
        assert not _alive(core)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
