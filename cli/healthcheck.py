"""gRPC health probe: ``python -m cli.healthcheck HOST:PORT [SERVICE] [--timeout S]``.

Exits 0 if the server answers SERVING for ``SERVICE`` (default: the whole server, ""), 1
otherwise. Used by docker-compose healthchecks and by the local launcher (no
``grpc_health_probe`` binary needed).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from protos.grpc.health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True if ``address`` reports SERVING for ``service`` within ``timeout_s`` seconds."""
    with grpc.insecure_channel(address) as channel:
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
    args = parser.parse_args(argv)
    ok = check(args.address, args.service, args.timeout)
    print("SERVING" if ok else "NOT SERVING", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
