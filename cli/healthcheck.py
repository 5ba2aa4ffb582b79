"""gRPC health probe: ``python -m cli.healthcheck HOST:PORT [SERVICE] [--timeout S]``.

Exits 0 if the server answers SERVING for ``SERVICE`` (default: the whole server, ""), 1
otherwise. With ``--tls-dir`` (default ``TANDEM_TLS_DIR``) it dials over TLS with a certificate
of that directory (workers require one); with ``--tls-ca`` (default ``TANDEM_TLS_CA``) it dials a
TLS gateway as a client does, trusting that CA. Used by docker-compose and Kubernetes
healthchecks, by ``tandem chat`` and by the local launcher (no ``grpc_health_probe`` binary needed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc


def _channel(address: str, tls_dir: str, ca_file: str) -> grpc.Channel:
    if not tls_dir:
        if ca_file:
            from cli.client import channel

            return channel(address, ca_file)
        return grpc.insecure_channel(address)
    from cluster.tls import CLUSTER_NAME, ROLES, TlsFiles

    role = next(r for r in ROLES if (Path(tls_dir) / f"{r}-key.pem").is_file())
    files = TlsFiles.load(tls_dir, role, "--tls-dir")
    return grpc.secure_channel(address, files.channel_credentials(),
                               options=[("grpc.ssl_target_name_override", CLUSTER_NAME)])


def check(address: str, service: str = "", timeout_s: float = 2.0, tls_dir: str = "", ca_file: str = "") -> bool:
    """True if ``address`` reports SERVING for ``service`` within ``timeout_s`` seconds
    (``tls_dir``: dial with a certificate of that TLS directory, ``cluster.tls``; else
    ``ca_file``: dial TLS trusting that CA certificate; neither: plaintext).

    Raises:
        OSError: ``ca_file`` cannot be read.
    """
    with _channel(address, tls_dir, ca_file) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.healthcheck", description=__doc__)
    parser.add_argument("address", help="host:port of a Tandem gateway or worker")
    parser.add_argument("service", nargs="?", default="", help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds")
    parser.add_argument("--tls-dir", default=os.environ.get("TANDEM_TLS_DIR", ""),
                        help="TLS directory (tandem certs init); default TANDEM_TLS_DIR")
    parser.add_argument("--tls-ca", default=os.environ.get("TANDEM_TLS_CA", ""),
                        help="CA certificate that verifies a TLS gateway (its ca.pem); default TANDEM_TLS_CA")
    args = parser.parse_args(argv)
    ok = check(args.address, args.service, args.timeout, args.tls_dir, args.tls_ca)
    print("SERVING" if ok else "NOT SERVING", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
