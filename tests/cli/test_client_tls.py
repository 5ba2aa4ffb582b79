"""The client commands against a real TLS gateway (in this process, its pool registered in the
real Redis at addresses that present the entries' certificates, then close: it reports SERVING
and its calls find no worker listening): the CA and the API key
come from flags or the documented variables, and every failure says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from cli.healthcheck import check
from cluster.registry import WorkerConfig
from cluster.tls import init_certs
from engine.block_hash import hash_seed
from gateway.auth import hash_key
from gateway.server import Gateway, load_served_model
from gateway.settings import GatewaySettings

from tests.helpers.paths import ROOT
from tests.helpers.gateway import ServerThread, instance_ports, register_workers
from tests.helpers.shared_redis import delete_keys

pytestmark = pytest.mark.slow
KEY = "key-of-carol"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, redis_url):
    """A TLS gateway with one API key, SERVING; yields (address, CA file)."""
    certs = tmp_path_factory.mktemp("certs")
    init_certs(str(certs))
    prefix = f"test-cli-tls-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(listen="127.0.0.1:0", metrics_port=0, tls_dir=str(certs), redis_url=redis_url,
                               redis_key_prefix=prefix, registry_ttl_s=3600, refresh_interval_s=0.1,
                               api_keys=[f"{hash_key(KEY)}:carol"])
    model = load_served_model(settings)
    config = WorkerConfig(model.model_id, 16, 2048, "float32", hash_seed(model.model_id, 16, "float32"), 49152)
    try:
        with ServerThread(Gateway(settings, model)) as server:
            address = f"127.0.0.1:{server.port}"
            # The gateway trusts an entry whose address presents its instance's certificate, for
            # minutes: after that the ports close, and a call that passes authentication finds
            # no worker listening.
            with instance_ports(certs) as ports:
                for role, worker_address in ports.items():
                    register_workers(redis_url, prefix, config, roles=(role,), address=worker_address)
                assert _eventually_serving(address, str(certs / "ca.pem"))
            yield address, str(certs / "ca.pem")
    finally:
        delete_keys(redis_url, prefix)


def _eventually_serving(address: str, ca: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check(address, timeout_s=2.0, ca_file=ca):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def tandem(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("TANDEM_TLS_CA", "TANDEM_API_KEY")}
    return subprocess.run([sys.executable, "-m", "cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**clean, **(env or {})})


def test_chat_reaches_a_tls_gateway_with_the_ca_from_the_variable_or_the_flag(gateway):
    address, ca = gateway
    assert tandem("chat", "--addr", address, env={"TANDEM_TLS_CA": ca}).returncode == 0
    assert tandem("chat", "--addr", address, "--tls-ca", ca).returncode == 0


def test_without_the_ca_the_client_commands_say_to_set_it(gateway):
    address, _ = gateway
    chat = tandem("chat", "--addr", address)
    assert chat.returncode == 1 and "TANDEM_TLS_CA" in chat.stderr and "--tls-ca" in chat.stderr, chat
    generate = tandem("generate", "hi", "--addr", address)
    assert generate.returncode == 1 and "TANDEM_TLS_CA" in generate.stderr, generate
    assert "assistant:" not in generate.stdout  # no dangling label before an error


def test_healthcheck_reads_the_ca_like_the_clients(gateway):
    address, ca = gateway
    probe = [sys.executable, "-m", "cli.healthcheck", address, "--timeout", "5"]
    assert subprocess.run(probe, capture_output=True, timeout=60, env={**os.environ, "TANDEM_TLS_CA": ca,
                                                                      "TANDEM_TLS_DIR": ""}).returncode == 0
    assert subprocess.run([*probe, "--tls-ca", ca, "--tls-dir", ""], capture_output=True, timeout=60).returncode == 0


def test_chat_stops_with_exit_1_when_the_gateway_refuses_the_key(gateway):
    address, ca = gateway
    refused = tandem("chat", "--addr", address, "--tls-ca", ca, stdin="hello\nagain\n")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused
    assert refused.stderr.count("UNAUTHENTICATED") == 1  # it stopped at the first refusal
    # with the key the call passes authentication (and then finds no worker listening)
    keyed = tandem("generate", "hi", "--addr", address, "--tls-ca", ca, "--api-key", KEY, "--max-tokens", "1")
    assert "UNAUTHENTICATED" not in keyed.stderr and "UNAVAILABLE" in keyed.stderr, keyed


def test_client_help_names_the_variables():
    for command in ("generate", "chat"):
        help_text = tandem(command, "--help").stdout
        for word in ("--tls-ca", "TANDEM_TLS_CA", "--api-key", "TANDEM_API_KEY", "TANDEM_GATEWAY_ADDR"):
            assert word in help_text, (command, word)
