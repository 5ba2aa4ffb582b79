"""Helpers of the gateway tests: a real Gateway on its own event loop in a background thread
(the tests use synchronous gRPC stubs), worker entries registered in the real Redis the
way workers register themselves, and a clock the tests move by hand."""

from __future__ import annotations

import asyncio
import threading

from cluster.registry import ClusterNamespace, Role, WorkerConfig, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
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


class Clock:
    """A ``time.monotonic`` stand-in: seconds in ``now``, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
