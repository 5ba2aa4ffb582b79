"""The worker process, shared by the prefill and decode workers: its engine core (a process of
its own, :class:`engine.core.core_client.EngineCoreClient`), the gRPC server
(:class:`cluster.server.ServerScaffold`), metrics, registration with the settings the worker
publishes, and the graceful drain on SIGTERM.

Shutdown order (:meth:`WorkerServer.shutdown`): health goes NOT_SERVING and new work is refused
with UNAVAILABLE; the worker leaves the Redis registry at once (so routers stop picking it while
it drains); in-flight requests get up to ``drain_timeout_s`` to finish, then whatever is left is
aborted, its streams ending UNAVAILABLE (the gateway retries or resumes them on another worker);
the server stops and the engine core exits.
Each close is bounded and a watchdog ends the process if the whole shutdown overruns
(:mod:`cluster.shutdown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
import torch

from cluster import tracing
from cluster.channels import server_keepalive_options
from cluster.health import SERVING
from cluster.heartbeat import Heartbeat
from cluster.identity import check_own_instance
from cluster.log import configure_logging, request_id_var
from cluster.metrics import WorkerMetrics
from cluster.prefix_index import PrefixIndex
from cluster.registry import ClusterNamespace, Role, WorkerConfig, WorkerInfo, WorkerLoad, WorkerRegistry, redis_client
from cluster.server import Admission, BindError, ServerScaffold, StartupError
from cluster.settings import WorkerSettings, advertised_address, setting_name
from cluster.shutdown import exit_if_shutdown_hangs, shutdown_step
from cluster.tls import ClientCredentials, PeerRoleInterceptor, server_credentials
from cluster.translate import check_request_id
from engine.core.core_client import EngineCoreClient, EngineDeadError, EngineError
from engine.core.messages import EngineInfo
from engine.runner.devices import device_ids, resolve_device, use_device
from kvtransfer import GRPC_MESSAGE_OPTIONS, KVPool
from kvtransfer.digest import compile_digests
from kvtransfer.nixl import NixlAgent
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2

logger = logging.getLogger(__name__)

def kv_transport(settings: WorkerSettings, worker_id: str, pool: KVPool) -> tuple[list[str], NixlAgent | None]:
    """The KV transports this worker uses, preferred first, and its NIXL agent (its KV pool
    registered) when NIXL is one of them; the pool's digest kernel is compiled meanwhile (both
    transports digest every block).

    Raises:
        StartupError: ``kv_transport`` is ``nixl`` but NIXL cannot start here.
    """
    compile_digests(pool)
    if settings.kv_transport == "grpc":
        return ["grpc"], None
    try:
        agent = NixlAgent(f"{worker_id}-{uuid.uuid4().hex[:8]}", pool)
    except (ImportError, RuntimeError) as exc:
        if settings.kv_transport == "nixl":
            raise StartupError(f"{setting_name(WorkerSettings, 'kv_transport')} is nixl, but NIXL cannot start "
                               f"here: {exc}") from None
        logger.info("NIXL unavailable (%s): KV moves over the gRPC stream", exc)
        return ["grpc"], None
    return (["nixl"] if settings.kv_transport == "nixl" else ["nixl", "grpc"]), agent


def worker_tls(settings: WorkerSettings, role: Role) -> ClientCredentials | None:
    """The credentials this worker dials its peers with, from ``tls_dir`` and followed as its
    files change (``None``: plaintext).

    Raises:
        StartupError: a file is missing or unreadable, or the key does not match the
            certificate (named, with the setting).
    """
    if not settings.tls_dir:
        return None
    try:
        return ClientCredentials(settings.tls_dir, str(role), setting_name(WorkerSettings, "tls_dir"))
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def published_config(info: EngineInfo, kv_pools: list[torch.Tensor], kv_transports: list[str],
                     serves_prefill: bool = False) -> WorkerConfig:
    """The cache settings a worker owns, as it publishes them (registry entry, ``GetStats``), with
    the KV transports it moves blocks with, the GPUs its ranks' KV pools (``kv_pools``) lie on
    and, for a decode worker, whether it also serves ``tandem.v1.PrefillWorker``."""
    return WorkerConfig(info.model_id, info.block_size, info.max_model_len, info.kv_cache_dtype, info.hash_seed,
                        info.vocab_size, info.tensor_parallel_size, tuple(kv_transports), info.quantization,
                        info.max_num_batched_tokens, device_ids(kv_pools), serves_prefill)


async def abort_request_id(request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext) -> str:
    """The request id an ``Abort`` call names, checked (:func:`cluster.translate.check_request_id`)
    and set as its log lines' request id.

    Raises:
        grpc.aio.AbortError: through ``context.abort``, ``INVALID_ARGUMENT`` for a bad id.
    """
    try:
        check_request_id(request.request_id)
    except StatusError as exc:
        await context.abort(exc.code, exc.message)
    request_id_var.set(request.request_id)
    return request.request_id


@contextlib.asynccontextmanager
async def request_outcome(method: str, metrics: WorkerMetrics,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[float]:
    """Around a worker's request RPC (``Prefill``, ``Decode``): answer its failure with a gRPC
    status and count the call by ``method`` and status (``WorkerMetrics.requests``, its seconds in
    ``WorkerMetrics.e2e``). Yields the call's start (``time.perf_counter``, seconds).

    A ``StatusError`` is answered with its own code (logged); an ``EngineError`` with
    ``UNAVAILABLE`` when the engine died (its worker is going away: the gateway retries or
    resumes the request on another worker), else ``INTERNAL``; a cancellation (the caller gone,
    its deadline) is counted as ``CANCELLED`` and goes on.

    Raises:
        grpc.aio.AbortError: through ``context.abort``, for the failures above.
    """
    start, status = time.perf_counter(), "OK"
    try:
        yield start
    except StatusError as exc:
        status = exc.code.name
        logger.info("%s failed: %s", method, exc)
        await context.abort(exc.code, exc.message)
    except EngineError as exc:
        code = grpc.StatusCode.UNAVAILABLE if isinstance(exc, EngineDeadError) else grpc.StatusCode.INTERNAL
        status = code.name
        await context.abort(code, str(exc))
    except (asyncio.CancelledError, GeneratorExit):  # (GeneratorExit: a streaming handler closed)
        status = "CANCELLED"
        raise
    finally:
        metrics.requests.labels(method, status).inc()
        metrics.e2e.labels(method).observe(time.perf_counter() - start)


class WorkerServicer(Protocol):
    """What :class:`WorkerServer` needs from a worker's servicer."""

    config: WorkerConfig  # what the worker publishes
    admission: Admission

    def add_to_server(self, server: grpc.aio.Server) -> None: ...

    def services(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """The gRPC services it adds to the server, by full name (``"tandem.v1.DecodeWorker"``),
        each with, per method, the roles whose certificates may call it under mTLS (``cluster.tls``)."""
        ...

    def pending(self) -> int:
        """Work in flight outside RPCs (e.g. reservations waiting for their transfer)."""
        ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------- server
class WorkerServer:
    """One worker process's server around an :class:`EngineCoreClient` and a servicer.

    Args:
        settings: the worker's settings (listen address, Redis, metrics port, drain timeout).
        role: the worker's pool.
        engine: the running engine.
        servicer: the worker's gRPC servicer.
        metrics: the worker's metrics (served on ``settings.metrics_port`` if non-zero).

    Both pools publish their prefix caches to the prefix index: the gateway routes a prompt to
    the prefill worker that holds its prefix, and a chat's next turn to the decode worker that
    holds the previous answer.
    """

    def __init__(self, settings: WorkerSettings, role: Role, engine: EngineCoreClient, servicer: WorkerServicer,
                 metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.role = role
        self.engine = engine
        self.servicer = servicer
        self.metrics = metrics
        self.worker_id = settings.resolved_worker_id(str(role))
        self.address = ""  # advertised, set by start()
        self.port = 0
        self._scaffold: ServerScaffold | None = None
        self._heartbeat = None
        self._redis = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._shutting_down = False
        self._stopped = asyncio.Event()
        self._drain = True
        self.exit_code = 0

    async def start(self) -> str:
        """Bind, start serving, register in Redis; returns the advertised address.

        With ``tls_dir`` the port speaks TLS only and requires a client certificate of the
        cluster CA; without it, plaintext (a warning: any caller that reaches the port is served).

        Raises:
            BindError: the listen address or the metrics port cannot be bound.
            StartupError: neither TLS nor ``insecure`` is set, the TLS files cannot be read, or
                (with Redis) the certificate does not name this worker's id (``cluster.identity``).
        """
        s = self.settings
        try:
            s.check_transport_security()
            credentials = (server_credentials(s.tls_dir, str(self.role), True, setting_name(WorkerSettings, "tls_dir"))
                           if s.tls_dir else None)
            if s.tls_dir and s.redis_url:  # a registry entry the gateway trusts names this instance
                check_own_instance(s.tls_dir, str(self.role), self.worker_id, setting_name(WorkerSettings, "tls_dir"))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        services = self.servicer.services()
        roles = [PeerRoleInterceptor(name, methods) for name, methods in services.items()] if credentials else []
        self._scaffold = scaffold = ServerScaffold(
            list(services),
            [*GRPC_MESSAGE_OPTIONS, *server_keepalive_options(s.keepalive_time_s, s.keepalive_timeout_s)],
            reflection=s.reflection, interceptors=roles)
        self.servicer.add_to_server(scaffold.server)
        self.port = scaffold.bind(s.listen, setting_name(WorkerSettings, "listen"), credentials)
        if s.health_port:
            scaffold.serve_probes(s.listen_host, s.health_port, setting_name(WorkerSettings, "health_port"))
        self.metrics.serve(s.listen_host, s.metrics_port, setting_name(WorkerSettings, "metrics_port"))
        await scaffold.start()
        if credentials is None:
            logger.warning("insecure: the worker port is plaintext and serves any caller that reaches it (no %s)",
                           setting_name(WorkerSettings, "tls_dir"))
        self.address = advertised_address(s.listen_host, self.port, s.advertise)
        await scaffold.health.set_all(SERVING)
        if s.redis_url:
            self._start_heartbeat()
        logger.info("%s worker %s listening on %s (bound %s:%d)", self.role, self.worker_id, self.address,
                    s.listen_host, self.port)
        return self.address

    @property
    def health(self):
        """The server's :class:`cluster.health.HealthServicer` (after :meth:`start`)."""
        return self._scaffold.health

    def _start_heartbeat(self) -> None:
        s = self.settings
        self._redis = redis_client(s.redis_url, password=s.redis_password, tls_ca=s.redis_tls_ca)
        ns = ClusterNamespace(s.redis_key_prefix, s.registry_ttl_s)

        def load() -> WorkerLoad:
            st = self.engine.stats()
            return WorkerLoad(st.num_running, st.num_waiting + self.servicer.pending(), st.num_free_blocks,
                              st.num_total_blocks)

        index, blocks = PrefixIndex(self._redis, ns), self.engine.block_events
        info = WorkerInfo(self.worker_id, self.role, self.address, self.servicer.config)
        self._heartbeat = Heartbeat(WorkerRegistry(self._redis, ns), info, load, index=index, blocks=blocks,
                                    interval_s=s.heartbeat_interval_s)
        self._heartbeat.start()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT start :meth:`shutdown` (once) and arm the process's shutdown
        watchdog (:func:`cluster.shutdown.exit_if_shutdown_hangs`): call only in the worker
        process."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self._shutdown_task is None:
            exit_if_shutdown_hangs(self.settings.drain_timeout_s)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self.shutdown())

    def fail(self, reason: str) -> None:
        """The engine is gone (its process died or hung, or a tensor-parallel rank died,
        ``reason``): stop at once, without draining (nothing can finish), and exit with status 1.
        Requests in flight have failed with UNAVAILABLE, which the gateway retries or resumes
        elsewhere; the watchdog ends the process if a close hangs."""
        if self.exit_code:
            return
        logger.error("%s: stopping the worker", reason)
        self.exit_code, self._drain = 1, False
        self.engine.fail_all(reason)  # before the shutdown's abort: the streams end UNAVAILABLE
        if self._shutdown_task is None:
            exit_if_shutdown_hangs(0.0)
        self.request_shutdown()

    async def shutdown(self) -> None:
        """Drain and stop (idempotent: a later call waits for the first to finish; see the module
        docstring for the order). Admission closed beforehand, from outside, is not a shutdown
        begun: the drain and the stop still run."""
        if self._shutting_down:
            await self._stopped.wait()
            return
        self._shutting_down = True
        self.servicer.admission.open = False
        if self._scaffold is not None:
            await shutdown_step("health NOT_SERVING", self._scaffold.health.shutdown())
        logger.info("shutting down: draining %d in-flight requests (at most %.1f s)",
                    self.servicer.admission.in_flight + self.servicer.pending(), self.settings.drain_timeout_s)
        if self._heartbeat is not None:
            await shutdown_step("leaving the registry", self._heartbeat.stop())
        drained = await self.servicer.admission.wait_idle(self.settings.drain_timeout_s if self._drain else 0.0,
                                                          self.servicer.pending)
        if not drained and self.engine.is_running:
            aborted = await self.engine.abort_all("the worker stopped: its drain ran out of time")
            logger.warning("drain timed out; failed %d requests (UNAVAILABLE: retried or resumed elsewhere)", aborted)
            await self.servicer.admission.wait_idle(2.0, self.servicer.pending)
        await shutdown_step("closing peer channels", self.servicer.close())
        if self._scaffold is not None:
            await shutdown_step("stopping the gRPC server", self._scaffold.stop(1.0))
        await shutdown_step("stopping the engine", self.engine.shutdown())
        if self._redis is not None:
            await shutdown_step("closing the Redis client", self._redis.aclose())
        self.metrics.close()
        logger.info("worker %s stopped", self.worker_id)
        self._stopped.set()

    async def wait(self) -> None:
        """Return once :meth:`shutdown` has finished."""
        await self._stopped.wait()


# ----------------------------------------------------------------------- process
def run_worker(settings: WorkerSettings, role: Role,
               make: Callable[[EngineCoreClient, WorkerSettings, WorkerMetrics], WorkerServicer]) -> int:
    """Start the engine core, serve until SIGTERM/SIGINT, drain; returns the exit code (0; 1 when
    an address cannot be bound or a setting cannot work here, after one line on stderr naming
    it, or when the engine core died)."""
    configure_logging(settings.log_level)
    if tracing.configure(f"tandem-{role}"):  # before the channels and the server are built
        logger.info("OpenTelemetry tracing on (OTLP)")

    async def main() -> int:
        # This thread's GPU work (KV transfers) is on the worker's GPU.
        use_device(resolve_device(settings.engine.device))
        # The engine core is the process's heavy PyTorch user, in a process of its own; this one
        # only copies KV blocks.
        torch.set_num_threads(1)
        try:
            engine = await EngineCoreClient.spawn(settings.model or None, settings.engine,
                                                  settings.load_format, hang_timeout_s=settings.engine_hang_timeout_s)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        metrics = WorkerMetrics(str(role), engine.stats)
        try:
            server = WorkerServer(settings, role, engine, make(engine, settings, metrics), metrics)
            await server.start()
        except (BindError, StartupError):
            await engine.shutdown()
            raise
        server.install_signal_handlers()
        engine.on_death(server.fail)
        await server.wait()
        return server.exit_code

    try:
        code = asyncio.run(main())
    except (BindError, StartupError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        tracing.shutdown()
    if code:  # the engine died: leave without the interpreter's teardown of what talked to it
        logging.shutdown()
        os._exit(code)
    return code
