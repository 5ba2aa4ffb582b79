"""The ``tandem`` command line, the servers' flags, the health probe and the compose file,
without a cluster: every error is one line and a non-zero exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.launcher import free_port
from cluster.settings import WorkerSettings, from_args
from gateway.settings import GatewaySettings

ROOT = Path(__file__).resolve().parents[2]


def tandem(*args: str, stdin: str = "", timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``tandem ARGS`` (as ``python -m cli``) and capture its output."""
    return subprocess.run([sys.executable, "-m", "cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def test_cli_lists_every_command():
    result = tandem("--help")
    assert result.returncode == 0
    for command in ("gateway", "prefill", "decode", "serve", "demo", "generate", "chat", "offline-chat"):
        assert command in result.stdout


@pytest.mark.parametrize("args,word", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens"),
    (["generate", "hi", "--temperature", "-2"], "--temperature"),
    (["generate", "hi", "--bogus"], "--bogus"),
    (["offline-chat", "hi", "--max-tokens", "-1"], "--max-tokens"),  # refused before the model loads
    (["no-such-command"], "no-such-command"),
    (["gateway", "--listen", "nonsense"], "--listen / TANDEM_GATEWAY_ADDR"),
    (["prefill", "--block-size", "17"], "--block-size / TANDEM_BLOCK_SIZE"),
    (["decode", "--no-such-flag", "1"], "--no-such-flag"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, word):
    result = tandem(*args)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in result.stderr, result.stderr


def test_serve_without_local_explains_itself():
    result = tandem("serve")
    assert result.returncode == 2 and "--local" in result.stderr


def test_client_commands_fail_with_one_line_when_no_gateway_answers():
    address = f"127.0.0.1:{free_port()}"
    chat = tandem("chat", "--addr", address, stdin="hello\n")
    assert chat.returncode == 1 and len(chat.stderr.strip().splitlines()) == 1, chat
    generate = tandem("generate", "hi", "--addr", address, "--max-tokens", "2")
    assert generate.returncode == 1 and "UNAVAILABLE" in generate.stderr and "Traceback" not in generate.stderr


def test_server_help_lists_every_flag_and_boolean_flags_take_no_value():
    for command, settings_cls in (("prefill", WorkerSettings), ("decode", WorkerSettings),
                                  ("gateway", GatewaySettings)):
        result = tandem(command, "--help")
        assert result.returncode == 0, result
        for field in settings_cls.model_fields:
            assert f"--{field.replace('_', '-')}" in result.stdout, (command, field)
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in tandem("decode", "--help").stdout
    assert "<bool>" not in tandem("generate", "--help").stdout
    assert "--chat / --raw" in tandem("generate", "--help").stdout


def test_flags_win_over_the_environment_and_lists_split(monkeypatch):
    monkeypatch.setenv("TANDEM_GATEWAY_ADDR", "0.0.0.0:6000")
    monkeypatch.setenv("TANDEM_REDIS_KEY_PREFIX", "prod")
    monkeypatch.setenv("TANDEM_STATIC_DECODE", "a:1, b:2")
    s = from_args(GatewaySettings, ["--redis-key-prefix", "staging"], "gateway", "")
    assert (s.listen, s.redis_key_prefix, s.static_decode) == ("0.0.0.0:6000", "staging", ["a:1", "b:2"])
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_BATCH_SIZES", "1, 2,4")
    w = from_args(WorkerSettings, ["--no-enable-prefix-caching", "--block-size", "32", "--enforce-eager"], "worker", "")
    config = w.engine_config()
    assert (w.enable_prefix_caching, config.block_size, config.enforce_eager) == (False, 32, True)
    assert config.cuda_graph_batch_sizes == [1, 2, 4]
    w = from_args(WorkerSettings, ["--cuda-graph-batch-sizes", "8,16"], "worker", "")
    assert w.engine_config().cuda_graph_batch_sizes == [8, 16]
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_TOKEN_SIZES", "512, 64")
    assert from_args(WorkerSettings, [], "worker", "").engine_config().cuda_graph_token_sizes == [64, 512]
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_TOKEN_SIZES", "")  # none: decode graphs only
    assert from_args(WorkerSettings, [], "worker", "").engine_config().cuda_graph_token_sizes == []
    assert from_args(WorkerSettings, [], "worker", "").engine_config().cuda_graph_batch_sizes == [1, 2, 4]
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "fp8_e4m3")
    assert from_args(WorkerSettings, [], "worker", "").engine_config().kv_cache_dtype == "fp8_e4m3"
    w = from_args(WorkerSettings, ["--kv-cache-dtype", "auto"], "worker", "")
    assert w.engine_config().kv_cache_dtype == "auto"


def test_free_port_never_hands_out_a_port_twice():
    """Ports picked but not yet bound look free to the next pick: 500 picks (from ~20k ports at
    random, a repeat all but certain) are 500 ports (a full run gave two workers of one cluster
    the same one)."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_healthcheck_fails_on_a_closed_port():
    probe = subprocess.run([sys.executable, "-m", "cli.healthcheck", f"127.0.0.1:{free_port()}",
                            "--timeout", "0.5"], capture_output=True, timeout=30)
    assert probe.returncode == 1


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid_and_workers_have_no_host_ports():
    compose = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config"]
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_REDIS_PASSWORD"}
    refused = subprocess.run(compose, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "TANDEM_REDIS_PASSWORD" in refused.stderr  # no Redis without one
    out = subprocess.run(compose, capture_output=True, text=True, timeout=60,
                         env={**env, "TANDEM_REDIS_PASSWORD": "s3cret"})
    assert out.returncode == 0, out.stderr
    import yaml

    services = yaml.safe_load(out.stdout)["services"]
    assert set(services) == {"redis", "certs", "gateway", "prefill", "decode", "prefill-tp2", "decode-tp2"}
    # a two-GPU host: each worker on its own GPU; the tp2 profile's workers on both, at TP=2
    placement = {"prefill": (["0"], None), "decode": (["1"], None), "prefill-tp2": (["0", "1"], "2"),
                 "decode-tp2": (["0", "1"], "2")}
    for worker, (gpus, tp) in placement.items():
        assert "ports" not in services[worker] and "container_name" not in services[worker]
        [device] = services[worker]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["device_ids"] == gpus
        assert services[worker]["environment"].get("TANDEM_TENSOR_PARALLEL_SIZE") == tp
        assert services[worker].get("profiles") == (["tp2"] if tp else None)
    def host_and_target(port) -> tuple[str, int]:  # a long-syntax dict or "[host:]published:target[/tcp]"
        if isinstance(port, dict):
            return port.get("host_ip", ""), int(port["target"])
        parts = port.split("/")[0].split(":")
        return (parts[0] if len(parts) == 3 else ""), int(parts[-1])

    published = dict(host_and_target(p)[::-1] for p in services["gateway"]["ports"])
    # gRPC and the OpenAI-compatible HTTP API on every interface, metrics on loopback
    assert published == {50051: "", 8000: "", 9400: "127.0.0.1"}
    for name in ("gateway", "prefill", "decode", "prefill-tp2", "decode-tp2"):
        env_of = services[name]["environment"]
        assert env_of["TANDEM_REDIS_PASSWORD"] == "s3cret" and env_of["TANDEM_TLS_DIR"] == "/certs"
        # each role sees its own certificate volume only, read-only
        sources = [v.get("source", "") if isinstance(v, dict) else str(v).split(":")[0] for v in services[name]["volumes"]]
        assert [s for s in sources if s.startswith("certs")] == [f"certs-{name.removesuffix('-tp2')}"], sources
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "s3cret"
