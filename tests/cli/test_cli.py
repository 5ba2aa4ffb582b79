"""The ``tandem`` command line, the servers' flags and the health probe, without a cluster: every
error is one line and a non-zero exit, and what the recipes write to files is whole lines."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest

from cli.launcher import free_port
from cluster.settings import WorkerSettings, from_args, settings_fields
from decode_worker.settings import DecodeWorkerSettings
from gateway.auth import hash_key
from gateway.settings import GatewaySettings
from tests.helpers.paths import ROOT


def tandem(*args: str, stdin: str = "", timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``tandem ARGS`` (as ``python -m cli``) and capture its output."""
    return subprocess.run([sys.executable, "-m", "cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


def test_cli_lists_every_command():
    result = tandem("--help")
    assert result.returncode == 0
    for command in ("gateway", "prefill", "decode", "serve", "demo", "generate", "chat", "offline-chat", "plan"):
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
    for command, settings_cls in (("prefill", WorkerSettings), ("decode", DecodeWorkerSettings),
                                  ("gateway", GatewaySettings)):
        result = tandem(command, "--help")
        assert result.returncode == 0, result
        for field in settings_fields(settings_cls):
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
    config = w.engine
    assert (config.enable_prefix_caching, config.block_size, config.enforce_eager) == (False, 32, True)
    assert config.cuda_graph_batch_sizes == [1, 2, 4]
    w = from_args(WorkerSettings, ["--cuda-graph-batch-sizes", "8,16"], "worker", "")
    assert w.engine.cuda_graph_batch_sizes == [8, 16]
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_TOKEN_SIZES", "512, 64")
    assert from_args(WorkerSettings, [], "worker", "").engine.cuda_graph_token_sizes == [64, 512]
    monkeypatch.setenv("TANDEM_CUDA_GRAPH_TOKEN_SIZES", "")  # none: decode graphs only
    assert from_args(WorkerSettings, [], "worker", "").engine.cuda_graph_token_sizes == []
    assert from_args(WorkerSettings, [], "worker", "").engine.cuda_graph_batch_sizes == [1, 2, 4]
    monkeypatch.setenv("TANDEM_KV_CACHE_DTYPE", "fp8_e4m3")
    assert from_args(WorkerSettings, [], "worker", "").engine.kv_cache_dtype == "fp8_e4m3"
    w = from_args(WorkerSettings, ["--kv-cache-dtype", "auto"], "worker", "")
    assert w.engine.kv_cache_dtype == "auto"


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


def test_apikey_writes_whole_lines_to_files_that_the_documented_recipe_reads(tmp_path):
    """``tandem apikey NAME > key.txt 2> keys-file.txt`` then ``export TANDEM_API_KEYS=$(cat
    keys-file.txt)``, with a tenant name long enough that a line wrapped at 80 columns would break."""
    tenant = "tenant-with-a-rather-long-name"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS" and not k.startswith("TANDEM_")}
    with open(tmp_path / "key.txt", "w") as out, open(tmp_path / "keys-file.txt", "w") as err:
        made = subprocess.run([sys.executable, "-m", "cli", "apikey", tenant, "--max-streams", "4"], stdout=out,
                              stderr=err, cwd=ROOT, env=env, timeout=60)
    assert made.returncode == 0
    key = (tmp_path / "key.txt").read_text()
    assert key.count("\n") == 1
    assert (tmp_path / "keys-file.txt").read_text() == f"{hash_key(key.strip())}:{tenant}:4\n"
    read = subprocess.run(["bash", "-c", 'export TANDEM_API_KEYS=$(cat keys-file.txt) && exec "$0" -c "$1"',
                           sys.executable, "from gateway.auth import ApiKeys; from gateway.settings import "
                           "GatewaySettings; print(ApiKeys.parse(GatewaySettings().api_keys, 'k').tenant("
                           "open('key.txt').read().strip()))"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == f"Tenant(name='{tenant}', max_streams=4)"


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_certs_init_gives_the_gateway_certificate_the_names_its_clients_dial(tmp_path, how):
    from cryptography import x509

    names = "gw.example.com, 203.0.113.7"
    args, env = (["--san", names], {}) if how == "flag" else ([], {"TANDEM_GATEWAY_SANS": names})
    directory = tmp_path / ("a-directory-whose-path-is-longer-than-eighty-columns-once-" * 2)
    made = subprocess.run([sys.executable, "-m", "cli", "certs", "init", str(directory), *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, **env}, timeout=60)
    assert made.returncode == 0, made.stderr
    assert set(made.stdout.splitlines()) == {str(p) for p in directory.iterdir()}  # one whole path a line
    for role in ("gateway", "prefill", "decode"):
        san = x509.load_pem_x509_certificate((directory / f"{role}.pem").read_bytes()).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
        dialed = ("gw.example.com" in san.get_values_for_type(x509.DNSName),
                  ipaddress.ip_address("203.0.113.7") in san.get_values_for_type(x509.IPAddress))
        assert dialed == ((True, True) if role == "gateway" else (False, False)), role


def test_certs_issue_writes_an_instance_directory_whose_certificate_names_the_instance(tmp_path):
    from cluster.identity import certificate_instances

    assert tandem("certs", "init", str(tmp_path / "ca")).returncode == 0
    made = tandem("certs", "issue", str(tmp_path / "ca"), "decode", "decode-3", "--out", str(tmp_path / "d3"))
    assert made.returncode == 0, made
    assert set(made.stdout.splitlines()) == {str(tmp_path / "d3" / n) for n in ("ca.pem", "decode.pem", "decode-key.pem")}
    assert certificate_instances((tmp_path / "d3" / "decode.pem").read_bytes(), "decode") == ["decode-3"]
    refused = tandem("certs", "issue", str(tmp_path / "ca"), "gateway", "gw-1", "--out", str(tmp_path / "g"))
    assert refused.returncode == 2 and "role must be prefill or decode" in refused.stderr, refused


def test_certs_init_refuses_a_name_that_is_no_host_in_one_line(tmp_path):
    made = tandem("certs", "init", str(tmp_path / "ca"), "--san", "gw.example.com,not a host")
    assert made.returncode == 2, made
    [line] = made.stderr.strip().splitlines()
    assert "--san / TANDEM_GATEWAY_SANS" in line and "'not a host'" in line
    assert not (tmp_path / "ca").exists()
