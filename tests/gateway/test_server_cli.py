"""The ``tandem`` command line, the health probe and the compose file, without a cluster."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gateway.cli import app
from gateway.launcher import free_port
from gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]


def test_cli_lists_every_command():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("gateway", "prefill", "decode", "serve", "demo", "generate", "chat", "offline-chat"):
        assert command in result.output


def test_gateway_rejects_a_bad_setting_naming_it():
    result = CliRunner().invoke(app, ["gateway", "--listen", "nonsense"])
    assert result.exit_code == 2 and "listen" in result.output


def test_serve_without_local_explains_itself():
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2


def test_settings_read_the_workers_variables(monkeypatch):
    monkeypatch.setenv("TANDEM_GATEWAY_ADDR", "0.0.0.0:6000")
    monkeypatch.setenv("TANDEM_DTYPE", "bfloat16")
    monkeypatch.setenv("TANDEM_REDIS_KEY_PREFIX", "prod")
    monkeypatch.setenv("TANDEM_STATIC_DECODE", "a:1, b:2")
    monkeypatch.setenv("TANDEM_MODEL", "")
    s = GatewaySettings()
    assert (s.listen, s.resolved_kv_dtype(), s.redis_key_prefix, s.static_decode, s.model) == \
        ("0.0.0.0:6000", "bfloat16", "prod", ["a:1", "b:2"], None)


def test_healthcheck_fails_on_a_closed_port():
    probe = subprocess.run([sys.executable, "-m", "gateway.healthcheck", f"127.0.0.1:{free_port()}",
                            "--timeout", "0.5"], capture_output=True, timeout=30)
    assert probe.returncode == 1


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid_and_workers_have_no_host_ports():
    out = subprocess.run(["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import yaml

    services = yaml.safe_load(out.stdout)["services"]
    assert set(services) == {"redis", "gateway", "prefill", "decode"}
    for worker in ("prefill", "decode"):
        assert "ports" not in services[worker] and "container_name" not in services[worker]
        assert services[worker]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
