"""The public gRPC endpoint: ``tandem.v1.Gateway`` plus health, reflection and /metrics.

The servicer is a thin edge: it checks the request (:mod:`gateway.validation`), tokenizes it,
and hands it to :class:`~gateway.orchestrator.Orchestrator`; statuses map as DESIGN.md says.
:func:`serve` runs the process: loads the tokenizer and config (never the weights), keeps the
routing view fresh, and on SIGTERM/SIGINT reports NOT_SERVING, stops admitting, gives in-flight
requests ``drain_timeout_s`` and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.block_hash import hash_seed
from gateway import metrics
from gateway.orchestrator import ModelMeta, Orchestrator, RequestError, WorkerClients
from gateway.registry import ClusterNamespace, Role, WorkerRegistry, redis_client
from gateway.router import ClusterView
from gateway.settings import GatewaySettings
from gateway.validation import (
    InvalidArgument, Limits, check_input, check_prompt_ids, check_request_size, check_sampling, render_prompt,
)
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# Worker channels carry the KV-free control plane only; prompts of max_model_len ids fit easily.
_WORKER_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                           ("grpc.max_send_message_length", 64 << 20)]


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (the request being served by this task, or ``-``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def setup_logging(level: str = "INFO") -> None:
    """Log lines with the request id: ``... INFO gateway.orchestrator [req-1]: ...``."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


@dataclass
class Model:
    """What the gateway knows of the served model: its sizes and its tokenizer."""

    meta: ModelMeta
    tokenizer: object  # transformers fast tokenizer


def load_model_meta(settings: GatewaySettings) -> Model:
    """Resolve the model's config and tokenizer (no weights).

    Raises:
        ValueError: the model cannot be found, or has no tokenizer.
    """
    from engine.loader import merge_eos_token_ids, load_tokenizer, resolve_model
    from engine.model_config import ModelConfig

    source = resolve_model(settings.model)
    if source.path is None:
        raise ValueError(f"model={settings.model!r} has no tokenizer files; the gateway needs them")
    tokenizer = load_tokenizer(source.path)
    if tokenizer is None:
        raise ValueError(f"model={settings.model!r}: no tokenizer in {source.path}")
    config = ModelConfig.from_hf_dict(source.hf_config)
    max_model_len = settings.max_model_len or source.hf_config.get("max_position_embeddings")
    kv_dtype = settings.resolved_kv_dtype()
    meta = ModelMeta(
        model_id=source.model_id, max_model_len=int(max_model_len), block_size=settings.block_size,
        vocab_size=config.vocab_size, eos_token_ids=frozenset(merge_eos_token_ids(config, source.path, tokenizer)),
        kv_dtype=kv_dtype, hash_seed=hash_seed(source.model_id, settings.block_size, kv_dtype))
    return Model(meta, tokenizer)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """``tandem.v1.Gateway``: validation and translation; the request flow lives in the orchestrator."""

    def __init__(self, model: Model, orchestrator: Orchestrator | None, limits: Limits) -> None:
        self.model = model
        self.orchestrator = orchestrator
        self.limits = limits
        self.draining = False

    async def _prompt(self, request) -> list[int]:
        check_request_size(request, self.limits)
        which = check_input(request)
        ids = await asyncio.to_thread(render_prompt, request, which, self.model.tokenizer)
        check_prompt_ids("token_ids.ids" if which == "token_ids" else which, ids, self.limits)
        return ids

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        REQUEST_ID.set(request_id)
        started = time.monotonic()
        status = grpc.StatusCode.OK
        metrics.IN_FLIGHT.inc()
        try:
            if self.draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
            prompt = await self._prompt(request)
            sampling = check_sampling(request.sampling, len(prompt), self.limits)
            if self.orchestrator is None:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "this gateway has no cluster to route to")
            logger.info("generate: %d prompt tokens, n=%d, max_tokens=%d", len(prompt), sampling.n,
                        sampling.max_tokens)
            stream = self.orchestrator.generate(request_id, prompt, sampling, context.time_remaining)
            async with contextlib.aclosing(stream):
                async for response in stream:
                    await context.write(response)
        except InvalidArgument as exc:
            status = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(status, str(exc))
        except RequestError as exc:
            status = exc.code
            logger.info("generate failed: %s %s", exc.code.name, exc.details)
            await context.abort(exc.code, exc.details)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            logger.info("client cancelled")
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            logger.exception("generate failed")
            await context.abort(status, "internal error (see the gateway log)")
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(status.name).inc()
            metrics.E2E.observe(time.monotonic() - started)
            if status == grpc.StatusCode.OK:
                logger.info("generate done in %.3f s", time.monotonic() - started)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:
        try:
            check_request_size(request, self.limits)
            which = check_input(request)
            ids = await asyncio.to_thread(render_prompt, request, which, self.model.tokenizer)
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return gateway_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context) -> gateway_pb2.ModelInfo:
        meta = self.model.meta
        return gateway_pb2.ModelInfo(model_id=meta.model_id, max_model_len=meta.max_model_len,
                                     block_size=meta.block_size, vocab_size=meta.vocab_size)


def limits_from(settings: GatewaySettings, meta: ModelMeta) -> Limits:
    return Limits(max_model_len=meta.max_model_len, vocab_size=meta.vocab_size,
                  max_tokens_cap=settings.max_tokens_cap, max_n=settings.max_n, max_logprobs=settings.max_logprobs,
                  max_stop=settings.max_stop, max_stop_len=settings.max_stop_len,
                  max_stop_token_ids=settings.max_stop_token_ids, max_request_bytes=settings.max_request_bytes)


class Gateway:
    """The gateway process' parts, built by :meth:`start` and torn down by :meth:`stop`.

    ``with_cluster=False`` serves validation, Tokenize and GetModelInfo only (Generate answers
    UNAVAILABLE after validation): used by tests of the input checks.
    """

    def __init__(self, settings: GatewaySettings, model: Model | None = None, with_cluster: bool = True) -> None:
        self.settings = settings
        self.model = model or load_model_meta(settings)
        self.with_cluster = with_cluster
        self.port: int | None = None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._clients: WorkerClients | None = None
        self._redis = None
        self.view = None
        self.orchestrator: Orchestrator | None = None
        self.servicer: GatewayServicer | None = None

    async def start(self) -> int:
        """Bind, start serving, mark SERVING; returns the bound port."""
        s, meta = self.settings, self.model.meta
        if self.with_cluster:
            self._clients = WorkerClients(_WORKER_CHANNEL_OPTIONS)
            self.view = self._build_view(meta)
            await self.view.refresh()
            self._tasks.append(asyncio.get_running_loop().create_task(self._refresh_loop(), name="refresh"))
            self.orchestrator = Orchestrator(self.view, self._clients, meta,
                                             self.model.tokenizer.backend_tokenizer, s.admit_wait_s, s.lease_ms)
        self.servicer = GatewayServicer(self.model, self.orchestrator, limits_from(s, meta))
        # gRPC's own limit sits above max_request_bytes so that a request between the two gets
        # INVALID_ARGUMENT naming "request" (larger ones: RESOURCE_EXHAUSTED from gRPC itself).
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", 2 * s.max_request_bytes),
                                                ("grpc.so_reuseport", 0)])
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self._server)
        self.port = self._server.add_insecure_port(s.listen)
        if not self.port:
            raise RuntimeError(f"cannot bind {s.listen}")
        await self._server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        host = s.listen.rpartition(":")[0]
        logger.info("listening on %s:%d (model %s, max_model_len %d, block_size %d, kv_dtype %s, %s)", host,
                    self.port, meta.model_id, meta.max_model_len, meta.block_size, meta.kv_dtype,
                    f"redis {s.redis_url}" if s.redis_url else f"static workers {s.static_prefill}+{s.static_decode}")
        return self.port

    def _build_view(self, meta: ModelMeta) -> ClusterView:
        s = self.settings
        ns = ClusterNamespace(s.redis_key_prefix, meta.model_id, s.block_size, s.registry_ttl_s)
        if s.redis_url:
            from gateway.prefix_index import PrefixIndex

            self._redis = redis_client(s.redis_url)
            return ClusterView(WorkerRegistry(self._redis, ns), PrefixIndex(self._redis, ns))
        from gateway.static_cluster import RoutedPrefixIndex, StaticRegistry

        logger.warning("no Redis configured: static workers prefill=%s decode=%s, in-process prefix index "
                       "built from this gateway's own routing", s.static_prefill, s.static_decode)
        registry = StaticRegistry(self._clients, {Role.PREFILL: s.static_prefill, Role.DECODE: s.static_decode}, ns)
        return ClusterView(registry, RoutedPrefixIndex())

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_interval_s)
            try:
                await self.view.refresh()
            except Exception:  # refresh handles Redis errors itself; anything else must not stop routing
                logger.exception("cluster refresh failed")

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, give in-flight ones ``grace_s`` (default drain_timeout_s), close."""
        grace_s = self.settings.drain_timeout_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.draining = True
        if self._server is not None:
            await self._server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        if self.orchestrator is not None:
            await self.orchestrator.drain_aborts()
        if self._clients is not None:
            await self._clients.close()
        if self._redis is not None:
            await self._redis.aclose()


async def serve(settings: GatewaySettings) -> None:
    """Run the gateway until SIGTERM or SIGINT, then drain and return."""
    if settings.metrics_port:
        from prometheus_client import start_http_server

        host = settings.listen.rpartition(":")[0].strip("[]")
        start_http_server(settings.metrics_port, addr="0.0.0.0" if host in ("0.0.0.0", "::", "") else host)
        logger.info("metrics on :%d/metrics", settings.metrics_port)
    gateway = Gateway(settings)
    await gateway.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    logger.info("shutting down: NOT_SERVING, draining in-flight requests (at most %.0f s)", settings.drain_timeout_s)
    await gateway.stop()
    logger.info("stopped")
