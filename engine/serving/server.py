"""Plumbing shared by the prefill and decode workers: the grpc.aio server (health, reflection,
message-size options), Prometheus metrics, Redis registration, request-id logging, and the
graceful drain on SIGTERM.

Shutdown order (:meth:`WorkerServer.shutdown`): health goes NOT_SERVING and new work is refused
with UNAVAILABLE; the worker leaves the Redis registry at once (so routers stop picking it while
it drains); in-flight requests get up to ``drain_timeout_s`` to finish, then whatever is left is
aborted (streams end with finish reason ABORT); the server stops and the engine thread ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.serving.async_engine import AsyncEngine
from engine.serving.metrics import WorkerMetrics
from engine.serving.settings import WorkerSettings, advertised_address
from kvtransfer import GRPC_MESSAGE_OPTIONS

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------ request-id logging
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Stamps ``record.request_id`` with the id of the request the current task serves."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def configure_logging(level: str = "INFO") -> None:
    """Log to stderr as ``time level logger [request_id] message``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# ---------------------------------------------------------------------- admission
class Admission:
    """Whether the worker takes new work, and how much is in flight (for the drain).

    Servicers wrap each unit of work in :meth:`track` and call :meth:`check` where new work
    enters (``Prefill``, ``Admit``).
    """

    def __init__(self) -> None:
        self.open = True
        self.in_flight = 0
        self._changed = asyncio.Event()

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse new work with UNAVAILABLE once the worker is draining."""
        if not self.open:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._changed.set()

    async def wait_idle(self, timeout_s: float, extra: Callable[[], int] = lambda: 0) -> bool:
        """Wait until nothing is in flight (``in_flight + extra() == 0``); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight + extra() > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                # Re-check at least every 0.1 s: ``extra`` (e.g. live reservations) has no event.
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
        return True


class WorkerServicer(Protocol):
    """What :class:`WorkerServer` needs from a worker's servicer."""

    service_name: str  # full gRPC service name, e.g. "tandem.v1.DecodeWorker"
    admission: Admission

    def add_to_server(self, server: grpc.aio.Server) -> None: ...

    def pending(self) -> int:
        """Work in flight outside RPCs (e.g. reservations waiting for their transfer)."""
        ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------- server
class WorkerServer:
    """One worker process's server around an :class:`AsyncEngine` and a servicer.

    Args:
        settings: the worker's settings (listen address, Redis, metrics port, drain timeout).
        role: ``gateway.registry.Role`` of the worker.
        engine: the running engine.
        servicer: the worker's gRPC servicer.
        metrics: the worker's metrics (served on ``settings.metrics_port`` if non-zero).
        publish_blocks: publish prefix-cache block events to the Redis prefix index.
    """

    def __init__(self, settings: WorkerSettings, role, engine: AsyncEngine, servicer: WorkerServicer,
                 metrics: WorkerMetrics, publish_blocks: bool = False) -> None:
        self.settings = settings
        self.role = role
        self.engine = engine
        self.servicer = servicer
        self.metrics = metrics
        self.publish_blocks = publish_blocks
        self.worker_id = settings.resolved_worker_id(str(role))
        self.address = ""  # advertised, set by start()
        self.port = 0
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._heartbeat = None
        self._redis = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> str:
        """Bind, start serving, register in Redis; returns the advertised address."""
        server = grpc.aio.server(options=GRPC_MESSAGE_OPTIONS)
        self.servicer.add_to_server(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (self.servicer.service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        host = self.settings.listen.rpartition(":")[0]
        self.port = server.add_insecure_port(self.settings.listen)
        if not self.port:
            raise OSError(f"cannot listen on {self.settings.listen}")
        await server.start()
        self._server = server
        self.address = advertised_address(host, self.port, self.settings.advertise)
        for service in ("", self.servicer.service_name):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serve(self.settings.metrics_port)
        if self.settings.redis_url:
            self._start_heartbeat()
        logger.info("%s worker %s listening on %s (bound %s:%d)", self.role, self.worker_id, self.address,
                    host, self.port)
        return self.address

    def _start_heartbeat(self) -> None:
        from gateway.prefix_index import PrefixIndex
        from gateway.registry import (
            ClusterNamespace, Heartbeat, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client,
        )

        s = self.settings
        self._redis = redis_client(s.redis_url)
        ns = ClusterNamespace(s.redis_key_prefix, self.engine.engine.model_id, self.engine.block_size,
                              s.registry_ttl_s)

        def load() -> WorkerLoad:
            st = self.engine.stats()
            return WorkerLoad(st.num_running, st.num_waiting + self.servicer.pending(), st.num_free_blocks,
                              st.num_total_blocks)

        index = PrefixIndex(self._redis, ns) if self.publish_blocks else None
        blocks = self.engine.block_events if self.publish_blocks else None
        self._heartbeat = Heartbeat(WorkerRegistry(self._redis, ns), WorkerInfo(self.worker_id, self.role, self.address),
                                    load, index=index, blocks=blocks, interval_s=s.heartbeat_interval_s)
        self._heartbeat.start()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start :meth:`shutdown` (once)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)

    def request_shutdown(self) -> None:
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self.shutdown())

    async def shutdown(self) -> None:
        """Drain and stop (idempotent; see the module docstring for the order)."""
        if not self.servicer.admission.open:
            await self._stopped.wait()
            return
        self.servicer.admission.open = False
        await self.health.enter_graceful_shutdown()
        logger.info("shutting down: draining %d in-flight requests (at most %.1f s)",
                    self.servicer.admission.in_flight + self.servicer.pending(), self.settings.drain_timeout_s)
        if self._heartbeat is not None:
            await self._heartbeat.stop()
        drained = await self.servicer.admission.wait_idle(self.settings.drain_timeout_s, self.servicer.pending)
        if not drained:
            aborted = await self.engine.abort_all()
            logger.warning("drain timed out; aborted %d requests", aborted)
            await self.servicer.admission.wait_idle(2.0, self.servicer.pending)
        await self.servicer.close()
        if self._server is not None:
            await self._server.stop(1.0)
        await self.engine.shutdown()
        if self._redis is not None:
            await self._redis.aclose()
        self.metrics.close()
        logger.info("worker %s stopped", self.worker_id)
        self._stopped.set()

    async def wait(self) -> None:
        """Return once :meth:`shutdown` has finished."""
        await self._stopped.wait()


# ----------------------------------------------------------------------- process
def run_worker(settings: WorkerSettings, role, make: Callable[[AsyncEngine, WorkerSettings, WorkerMetrics],
                                                               WorkerServicer],
               publish_blocks: bool = False) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain; returns the exit code (0)."""
    from engine.llm_engine import LLMEngine

    configure_logging(settings.log_level)

    async def main() -> None:
        llm = await asyncio.to_thread(LLMEngine, settings.model or None, settings.engine_config(),
                                      settings.load_format)
        engine = AsyncEngine(llm, name=f"{role}-engine")
        engine.start()
        metrics = WorkerMetrics(str(role), engine.stats)
        server = WorkerServer(settings, role, engine, make(engine, settings, metrics), metrics, publish_blocks)
        await server.start()
        server.install_signal_handlers()
        await server.wait()

    asyncio.run(main())
    return 0


# ------------------------------------------------------------------- translation
def sampling_params_from_proto(msg, max_model_len: int):
    """``tandem.v1.SamplingParams`` → ``engine.SamplingParams`` (proto defaults: ``max_tokens`` 0 =
    up to ``max_model_len``, ``n`` 0 = 1, unset optionals = engine defaults).

    Raises:
        ValueError: a field is out of range; the message names it.
    """
    from engine.sampling_params import SamplingParams

    kwargs = {name: getattr(msg, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed")
              if msg.HasField(name)}
    return SamplingParams(
        max_tokens=msg.max_tokens or max_model_len, stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos, n=msg.n or 1,
        logprobs=msg.logprobs, **kwargs)


def token_logprobs(token_id: int, logprobs: dict[int, float], num_top: int):
    """One generated token and its log-probabilities as ``tandem.v1.TokenLogprobs``.

    ``logprobs`` is the engine's ``{token_id: logprob}`` of the sampled token plus the top
    ``num_top``; the top list is its ``num_top`` most likely entries.
    """
    from protos.tandem.v1 import gateway_pb2

    top = sorted(logprobs.items(), key=lambda kv: -kv[1])[:num_top] if num_top else []
    return gateway_pb2.TokenLogprobs(
        token_id=token_id, logprob=logprobs.get(token_id, 0.0),
        top_logprobs=[gateway_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def finish_reason_to_proto(reason: str | None) -> int:
    from protos.tandem.v1 import gateway_pb2

    return {None: gateway_pb2.FINISH_REASON_UNSPECIFIED, "stop": gateway_pb2.FINISH_REASON_STOP,
            "length": gateway_pb2.FINISH_REASON_LENGTH}.get(reason, gateway_pb2.FINISH_REASON_ABORT)


class RpcError(Exception):
    """A servicer's refusal: ends the call with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
