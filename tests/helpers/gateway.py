"""Helpers of the gateway tests: a real Gateway on its own event loop in a background thread
(the tests use synchronous gRPC stubs), worker entries registered in the real Redis the
way workers register themselves (and TLS ports presenting their instances' certificates), and a
clock the tests move by hand."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from cluster.registry import ClusterNamespace, Role, WorkerConfig, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from cluster.tls import TlsFiles, issue_instance_cert
from gateway.server import Gateway


class ServerThread:
    """A :class:`Gateway` served from a background thread; ``port`` once entered."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.port: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.port = await self.gateway.start()
        self._ready.set()
        await self._stop.wait()
        await self.gateway.stop(grace_s=0)

    def call(self, coroutine_fn, timeout_s: float = 10.0):
        """Run ``coroutine_fn()`` on the gateway's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine_fn(), self.loop).result(timeout_s)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30), "gateway did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def register_workers(redis_url: str, key_prefix: str, config: WorkerConfig, ttl_s: float = 3600.0,
                     roles: tuple[str, ...] = ("prefill", "decode"), address: str = "127.0.0.1:9") -> list[WorkerInfo]:
    """Register one worker per role under ``key_prefix`` with ``config``, at ``address``
    (default: where nothing listens, so requests that pass validation then fail to route:
    UNAVAILABLE)."""

    async def main() -> list[WorkerInfo]:
        client = redis_client(redis_url)
        registry = WorkerRegistry(client, ClusterNamespace(key_prefix, ttl_s))
        workers = [WorkerInfo(f"{role}-0", Role(role), address, config, WorkerLoad(free_blocks=1000,
                                                                                         total_blocks=1000))
                   for role in roles]
        for worker in workers:
            await registry.heartbeat(worker)
        await client.aclose()
        return workers

    return asyncio.run(main())


@contextlib.contextmanager
def instance_ports(ca_dir: Path, roles: tuple[str, ...] = ("prefill", "decode")) -> Iterator[dict[str, str]]:
    """Per role, a TLS port on loopback presenting the certificate of instance ``{role}-0``
    (issued from ``ca_dir``'s CA), as the registered worker would: the gateway's identity check
    (``cluster.identity``) accepts :func:`register_workers`' entries at these addresses. It
    serves no method; the ports close on exit. Yields role → address."""
    servers, addresses = [], {}
    try:
        for role in roles:
            out = ca_dir / "instances" / f"{role}-0"
            issue_instance_cert(str(ca_dir), role, f"{role}-0", str(out))
            files = TlsFiles.load(str(out), role, "tls_dir")
            server = grpc.server(ThreadPoolExecutor(1))
            port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
                [(files.key, files.cert)], root_certificates=files.ca, require_client_auth=True))
            server.start()
            servers.append(server)
            addresses[role] = f"127.0.0.1:{port}"
        yield addresses
    finally:
        for server in servers:
            server.stop(0)


class Clock:
    """A ``time.monotonic`` stand-in: seconds in ``now``, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
