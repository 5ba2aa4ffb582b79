"""Redis over TLS against a real TLS ``redis-server`` (its certificate from ``tandem certs init``):
the registry connects through a ``rediss://`` URL verified with the cluster CA and a password
(``redis_client``, the settings ``redis_url``, ``redis_tls_ca``, ``redis_password``); a
plaintext client, a client trusting another CA and one without the password are refused."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest
import redis

from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from cluster.tls import init_certs
from tests.helpers.worker_config import CONFIG

PASSWORD = "s3cret"


@pytest.fixture
def tls_redis(tmp_path):
    """A ``redis-server`` serving TLS only (the gateway certificate, whose names include
    127.0.0.1), with a password; yields its port and the CA file."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    certs = tmp_path / "certs"
    init_certs(str(certs))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port), "--dir", str(tmp_path),
         "--tls-cert-file", str(certs / "gateway.pem"), "--tls-key-file", str(certs / "gateway-key.pem"),
         "--tls-ca-cert-file", str(certs / "ca.pem"), "--tls-auth-clients", "no", "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            output = proc.stdout.read()
            if "tls" in output.lower() and ("not supported" in output or "Bad directive" in output):
                pytest.skip(f"this redis-server has no TLS: {output.strip()[-200:]}")
            raise RuntimeError(f"redis-server exited: {output}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        if time.monotonic() > deadline:
            raise RuntimeError("redis-server did not listen")
        time.sleep(0.05)
    yield port, str(certs / "ca.pem")
    proc.kill()
    proc.wait()


def test_registry_works_over_tls_and_other_clients_are_refused(tls_redis, tmp_path):
    port, ca = tls_redis
    url = f"rediss://127.0.0.1:{port}/0"
    worker = WorkerInfo("p0", Role.PREFILL, "10.0.0.1:50000", CONFIG, WorkerLoad(running=1, total_blocks=8))

    async def main() -> list[WorkerInfo]:
        client = redis_client(url, password=PASSWORD, tls_ca=ca)
        registry = WorkerRegistry(client, ClusterNamespace("tls-test", ttl_s=30.0))
        assert await registry.heartbeat(worker) is True
        live = await registry.live_workers(Role.PREFILL)
        await client.aclose()
        return live

    assert asyncio.run(main()) == [worker]

    other_ca = tmp_path / "other"
    init_certs(str(other_ca))

    async def refused(client) -> None:
        try:
            with pytest.raises((redis.ConnectionError, redis.AuthenticationError, redis.ResponseError)):
                await client.ping()
        finally:
            await client.aclose()

    asyncio.run(refused(redis_client(f"redis://127.0.0.1:{port}/0", password=PASSWORD)))  # plaintext
    asyncio.run(refused(redis_client(url, password=PASSWORD, tls_ca=str(other_ca / "ca.pem"))))  # another CA
    asyncio.run(refused(redis_client(url, tls_ca=ca)))  # no password
