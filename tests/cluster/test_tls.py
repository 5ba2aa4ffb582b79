"""mTLS among Tandem servers, on real gRPC servers on loopback: a worker port refuses plaintext,
a client certificate of another CA and a client without one; a channel that needs a decode
worker refuses a peer with another role's certificate; the channel cache is bounded."""

from __future__ import annotations

import asyncio
import stat

import grpc
import pytest

from cluster.channels import ChannelCache
from cluster.health import SERVING
from cluster.server import ServerScaffold
from cluster.tls import CLUSTER_NAME, ClientCredentials, TlsFiles, init_certs, role_name, server_credentials
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    init_certs(str(ours))
    init_certs(str(theirs))
    return str(ours), str(theirs)


def test_certs_init_writes_a_ca_and_a_certificate_per_role_with_private_keys(certs, tmp_path):
    written = {p.name for p in init_certs(str(tmp_path), ["tandem.example.com"])}
    assert written == {"ca.pem", "ca-key.pem", *(f"{r}{s}" for r in ("gateway", "prefill", "decode")
                                                   for s in (".pem", "-key.pem"))}
    assert stat.S_IMODE((tmp_path / "decode-key.pem").stat().st_mode) == 0o600
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "gateway.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert {"tandem.example.com", "localhost", CLUSTER_NAME, role_name("gateway")} <= set(names)


async def _server(tls_dir: str, role: str) -> tuple[ServerScaffold, str]:
    scaffold = ServerScaffold(["tandem.v1.Test"], reflection=True)
    port = scaffold.bind("127.0.0.1:0", "listen", server_credentials(tls_dir, role, True, "tls_dir"))
    await scaffold.start()
    await scaffold.health.set_all(SERVING)
    return scaffold, f"127.0.0.1:{port}"


async def _check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_worker_port_accepts_only_cluster_client_certificates(certs):
    ours, theirs = certs

    async def main():
        scaffold, address = await _server(ours, "decode")
        member = TlsFiles.load(ours, "gateway", "tls_dir")
        stranger = TlsFiles.load(theirs, "gateway", "tls_dir")
        name = [("grpc.ssl_target_name_override", CLUSTER_NAME)]
        clients = {
            "plaintext": grpc.aio.insecure_channel(address),
            "no client certificate": grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=member.ca), options=name),
            "another CA's certificate": grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials(member.ca, stranger.key, stranger.cert), options=name),
            "member": grpc.aio.secure_channel(address, member.channel_credentials(), options=name),
        }
        try:
            codes = {label: await _check(channel) for label, channel in clients.items()}
        finally:
            for channel in clients.values():
                await channel.close()
            await scaffold.stop(0)
        assert codes == {"plaintext": grpc.StatusCode.UNAVAILABLE,
                         "no client certificate": grpc.StatusCode.UNAVAILABLE,
                         "another CA's certificate": grpc.StatusCode.UNAVAILABLE,
                         "member": grpc.StatusCode.OK}

    asyncio.run(main())


def test_a_channel_for_decode_workers_refuses_a_peer_with_another_role(certs):
    ours, _ = certs

    async def main():
        prefill, prefill_address = await _server(ours, "prefill")
        decode, decode_address = await _server(ours, "decode")
        cache = ChannelCache(credentials=ClientCredentials(ours, "prefill", "tls_dir"), peer_name=role_name("decode"))
        try:
            assert await _check(cache.get(decode_address)) == grpc.StatusCode.OK
            assert await _check(cache.get(prefill_address)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await cache.close()
            await prefill.stop(0)
            await decode.stop(0)

    asyncio.run(main())


def test_the_channel_cache_is_bounded():
    async def main():
        cache = ChannelCache(max_channels=2)
        first = cache.get("127.0.0.1:1")
        cache.get("127.0.0.1:2")
        assert cache.get("127.0.0.1:1") is first  # now the most recently used
        cache.get("127.0.0.1:3")
        assert len(cache) == 2
        assert cache.get("127.0.0.1:1") is first  # 127.0.0.1:2 was evicted, not it
        await cache.close()

    asyncio.run(main())


def test_a_server_picks_up_rotated_certificates_without_a_restart(tmp_path):
    """The CA and the certificates are replaced on disk: new handshakes use the new ones
    (clients of the new CA get in, clients of the old one no longer do)."""
    directory = str(tmp_path / "certs")
    init_certs(directory)
    old = TlsFiles.load(directory, "gateway", "tls_dir")
    name = [("grpc.ssl_target_name_override", CLUSTER_NAME)]

    async def main():
        scaffold, address = await _server(directory, "decode")
        try:
            async with grpc.aio.secure_channel(address, old.channel_credentials(), options=name) as channel:
                assert await _check(channel) == grpc.StatusCode.OK
            await asyncio.sleep(0.01)  # a distinct modification time
            init_certs(directory)  # rotation: a new CA and new certificates
            new = TlsFiles.load(directory, "gateway", "tls_dir")
            async with grpc.aio.secure_channel(address, new.channel_credentials(), options=name) as channel:
                assert await _check(channel) == grpc.StatusCode.OK
            async with grpc.aio.secure_channel(address, old.channel_credentials(), options=name) as channel:
                assert await _check(channel) == grpc.StatusCode.UNAVAILABLE
        finally:
            await scaffold.stop(0)

    asyncio.run(main())


def test_a_key_that_does_not_match_its_certificate_is_refused_at_start(tmp_path):
    init_certs(str(tmp_path))
    (tmp_path / "decode-key.pem").write_bytes((tmp_path / "prefill-key.pem").read_bytes())
    with pytest.raises(ValueError, match="decode-key.pem does not belong"):
        server_credentials(str(tmp_path), "decode", True, "tls_dir")


def test_a_client_follows_rotated_certificates_without_a_restart(tmp_path):
    """The CA and every certificate are replaced on disk while a prefill worker's channel cache
    is open: its next calls dial with the new certificate and trust the new CA; a cache that
    does not look at the files again (the control) can no longer reach the server."""
    directory = str(tmp_path / "certs")
    init_certs(directory)

    async def main():
        server, address = await _server(directory, "decode")
        following = ChannelCache(credentials=ClientCredentials(directory, "prefill", "tls_dir", check_interval_s=0),
                                 peer_name=role_name("decode"))
        stale = ChannelCache(credentials=ClientCredentials(directory, "prefill", "tls_dir", check_interval_s=3600),
                             peer_name=role_name("decode"))
        try:
            before = following.get(address)
            assert await _check(before) == grpc.StatusCode.OK
            assert await _check(stale.get(address)) == grpc.StatusCode.OK
            await asyncio.sleep(0.01)  # a distinct modification time
            init_certs(directory)  # rotation: a new CA and new certificates
            after = following.get(address)  # the change seen: every channel retired, a new one dialed
            assert after is not before and await _check(after) == grpc.StatusCode.OK
            stale.reset(address)  # a new connection (an open one keeps its handshake), with the old files
            assert await _check(stale.get(address)) == grpc.StatusCode.UNAVAILABLE
        finally:
            await following.close()
            await stale.close()
            await server.stop(0)

    asyncio.run(main())
