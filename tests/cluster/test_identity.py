"""Identity bound to the registry entry, on real TLS servers on loopback and the real Redis: a
per-instance certificate is accepted for its own worker id; the same certificate (and the Redis
password) cannot register a second worker under another name, nor can a role's certificate
that names no instance."""

from __future__ import annotations

import asyncio
import logging
import stat

import pytest
import redis

from cli.redis_server import RedisServer
from cluster.identity import InstanceVerifier, certificate_instances, check_own_instance
from cluster.prefix_index import PrefixIndex
from cluster.registry import ClusterNamespace, Role, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from cluster.server import ServerScaffold
from cluster.tls import init_certs, instance_uri, issue_instance_cert, server_credentials
from gateway import metrics
from gateway.outlier import OutlierDetector
from gateway.router import ClusterView
from tests.helpers.worker_config import CONFIG


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ca")
    init_certs(str(directory))
    return directory


def test_an_instance_certificate_names_its_instance_and_its_directory_holds_no_ca_key(ca, tmp_path):
    written = {p.name for p in issue_instance_cert(str(ca), "prefill", "prefill-7", str(tmp_path / "p7"))}
    assert written == {"ca.pem", "prefill.pem", "prefill-key.pem"}
    assert stat.S_IMODE((tmp_path / "p7" / "prefill-key.pem").stat().st_mode) == 0o600
    cert = (tmp_path / "p7" / "prefill.pem").read_bytes()
    assert certificate_instances(cert, "prefill") == ["prefill-7"]
    assert certificate_instances(cert, "decode") == []  # the URI names the role too
    assert certificate_instances((ca / "prefill.pem").read_bytes(), "prefill") == []  # a role certificate
    assert instance_uri("prefill", "prefill-7") == "spiffe://tandem/prefill/prefill-7"
    with pytest.raises(ValueError, match="instance must match"):
        issue_instance_cert(str(ca), "prefill", "a/b", str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="ca-key.pem"):
        issue_instance_cert(str(tmp_path / "p7"), "prefill", "again", str(tmp_path / "bad"))


def test_a_worker_refuses_to_start_under_an_id_its_certificate_does_not_name(ca, tmp_path):
    issue_instance_cert(str(ca), "decode", "decode-0", str(tmp_path / "d0"))
    check_own_instance(str(tmp_path / "d0"), "decode", "decode-0", "TANDEM_TLS_DIR")
    with pytest.raises(ValueError, match=r"names instance\(s\) \['decode-0'\].*'decode-1'.*tandem certs issue"):
        check_own_instance(str(tmp_path / "d0"), "decode", "decode-1", "TANDEM_TLS_DIR")
    with pytest.raises(ValueError, match="names instance.*none"):
        check_own_instance(str(ca), "decode", "decode-0", "TANDEM_TLS_DIR")


async def _tls_server(tls_dir: str, role: str) -> tuple[ServerScaffold, str]:
    """A server presenting ``tls_dir``'s ``{role}.pem`` and requiring a cluster client certificate,
    as a worker port does."""
    scaffold = ServerScaffold(["tandem.v1.Test"], reflection=False)
    port = scaffold.bind("127.0.0.1:0", "listen", server_credentials(tls_dir, role, True, "tls_dir"))
    await scaffold.start()
    return scaffold, f"127.0.0.1:{port}"


def test_the_gateway_routes_only_to_entries_whose_address_presents_their_instance_certificate(
        ca, tmp_path, caplog):
    """The probe's attack: a fake prefill worker holding a real prefill instance certificate and
    the Redis password (a private redis-server that requires one, as `tandem serve --local`
    starts) registers under a new name; so does one with the role's certificate."""
    issue_instance_cert(str(ca), "prefill", "prefill-a", str(tmp_path / "a"))
    issue_instance_cert(str(ca), "decode", "decode-0", str(tmp_path / "d0"))
    caplog.set_level(logging.ERROR, logger="gateway.router")
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", password="s3cret")
    server.start()

    async def main():
        honest, honest_at = await _tls_server(str(tmp_path / "a"), "prefill")
        fake, fake_at = await _tls_server(str(tmp_path / "a"), "prefill")  # prefill-a's key, stolen
        role_only, role_only_at = await _tls_server(str(ca), "prefill")
        decode, decode_at = await _tls_server(str(tmp_path / "d0"), "decode")
        without_password = redis_client(server.url)
        with pytest.raises(redis.exceptions.AuthenticationError):  # the password is what the attacker needed
            await WorkerRegistry(without_password, ClusterNamespace("attack", 30.0)).live_workers(Role.PREFILL)
        await without_password.aclose()
        client = redis_client(server.url, password="s3cret")
        ns = ClusterNamespace("attack", 30.0)
        registry = WorkerRegistry(client, ns)
        entries = [WorkerInfo("prefill-a", Role.PREFILL, honest_at, CONFIG),
                   WorkerInfo("evil", Role.PREFILL, fake_at, CONFIG),
                   WorkerInfo("pointing-at-a", Role.PREFILL, honest_at, CONFIG),  # another's address
                   WorkerInfo("prefill-b", Role.PREFILL, role_only_at, CONFIG),
                   WorkerInfo("decode-0", Role.DECODE, decode_at, CONFIG, WorkerLoad(free_blocks=100, total_blocks=100))]
        for entry in entries:
            await registry.heartbeat(entry)
        verifier = InstanceVerifier(str(ca), "gateway", timeout_s=5.0)
        view = ClusterView(registry, PrefixIndex(client, ns), CONFIG.model_id, identity=verifier.refusal,
                           outliers=OutlierDetector(2, 5.0, 60.0))
        try:
            await view.refresh()
            assert [w.worker_id for w in view.workers(Role.PREFILL)] == ["prefill-a"]
            assert [w.worker_id for w in view.workers(Role.DECODE)] == ["decode-0"]
            assert metrics.UNTRUSTED_WORKERS._value.get() == 3
            for refused in ("evil", "pointing-at-a", "prefill-b"):
                assert f"refusing prefill worker {refused}" in caplog.text
            assert "names prefill instance(s) ['prefill-a'], not 'evil'" in caplog.text
            assert "names prefill instance(s) none, not 'prefill-b'" in caplog.text
            # The verdicts are cached: a second refresh makes no new handshake (prefill-a's port
            # is closed now), and routes the same.
            await honest.stop(0)
            await view.refresh()
            assert [w.worker_id for w in view.workers(Role.PREFILL)] == ["prefill-a"]
            # A real decode worker's address that stops answering is refused once its match expires.
            stale = InstanceVerifier(str(ca), "gateway", timeout_s=5.0, verified_ttl_s=0.0)
            assert await stale.refusal(entries[4]) is None
            await decode.stop(0)
            assert "completed no TLS handshake" in await stale.refusal(entries[4])
        finally:
            for port in (honest, role_only, decode, fake):
                await port.stop(0)
            await client.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()
