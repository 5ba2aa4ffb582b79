"""The public gRPC endpoint: ``tandem.v1.Gateway`` and KServe v2 (:mod:`gateway.kserve`, over the
same request path) plus health, reflection and /metrics.

The servicer is a thin edge: it checks the request (:mod:`gateway.validation` for the input
form, :mod:`cluster.translate` for the prompt and sampling, with the pool's limits), tokenizes
it, and hands it to :class:`~gateway.orchestrator.Orchestrator`; statuses map as
docs/architecture.md says. :func:`serve` runs the process: it resolves the model's tokenizer
and id (never the weights, never torch), keeps the routing view fresh, reports SERVING only
while a request can be routed, and on SIGTERM/SIGINT reports NOT_SERVING, ends health watches,
gives in-flight requests ``drain_timeout_s`` and exits. With OpenTelemetry on
(:mod:`cluster.tracing`) each call starts a trace that the workers continue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from cluster import tracing
from cluster.channels import ChannelCache, client_keepalive_options, server_keepalive_options
from cluster.health import NOT_SERVING, SERVING
from cluster.log import request_id_var
from cluster.periodic import PeriodicTask
from cluster.registry import ClusterNamespace, Role, WorkerConfig, WorkerRegistry, redis_client
from cluster.server import Admission, ServerScaffold, StartupError, serve_metrics
from cluster.settings import RequestLimits, setting_name
from cluster.shutdown import exit_if_shutdown_hangs, shutdown_step
from cluster.tls import ClientCredentials, role_name, server_credentials
from cluster.translate import REQUEST_ID_MAX_CHARS, check_prompt_ids, check_request_id, sampling_params_from_proto
from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from gateway import metrics
from gateway.auth import AuthInterceptor, tenant_var
from gateway import kserve
from gateway.heap import HeapTrimmer, return_large_buffers_to_the_os
from gateway.orchestrator import Orchestrator, WorkerClients
from gateway.outlier import OutlierDetector
from gateway.prober import HealthProber
from gateway.router import ClusterView
from gateway.settings import GatewaySettings
from gateway.tokenizer_pool import TokenizerPool
from gateway.placement import ServiceLevel
from gateway.validation import (check_input, check_prompt_bytes, check_request_size, check_service_level,
                                input_field, render_prompt)
from protos.status import StatusError
from protos.inference import grpc_service_pb2_grpc
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

# A call cancelled this close to its deadline was ended by the deadline (clocks and the network differ).
_DEADLINE_SLACK_S = 0.25
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# Worker channels carry the KV-free control plane only; prompts of max_model_len ids fit easily.
_WORKER_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                           ("grpc.max_send_message_length", 64 << 20)]


@dataclass(frozen=True)
class ServedModel:
    """What the gateway itself knows of the served model: its id and its tokenizer (``None``
    for a model without one: then only token-id prompts are served, with no text)."""

    model_id: str
    tokenizer: Tokenizer | None


def load_served_model(settings: GatewaySettings) -> ServedModel:
    """Resolve ``settings.model`` to its id and tokenizer (no weights, no torch).

    Raises:
        ValueError: the model cannot be found (naming ``model``).
    """
    source = resolve_model(settings.model or None)
    tokenizer = source.tokenizer()
    if tokenizer is not None:
        tokenizer.split_special_tokens = settings.chat_split_special_tokens
    return ServedModel(source.model_id, tokenizer)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """``tandem.v1.Gateway``: validation and translation; the request flow lives in the orchestrator.

    Args:
        model: the served model.
        view: the routing state (the pool's settings come from it).
        orchestrator: drives requests through the cluster.
        limits: the request caps (the workers check the same ones).
        max_request_bytes: serialized request size at most.
        max_prompt_bytes: UTF-8 bytes of prompt text at most, checked before tokenization.
        tokenizer_pool: where prompts are tokenized (bounded: RESOURCE_EXHAUSTED when full).
    """

    def __init__(self, model: ServedModel, view: ClusterView, orchestrator: Orchestrator, limits: RequestLimits,
                 max_request_bytes: int, max_prompt_bytes: int, tokenizer_pool: TokenizerPool) -> None:
        self.model = model
        self.view = view
        self.orchestrator = orchestrator
        self.limits = limits
        self.max_request_bytes = max_request_bytes
        self.max_prompt_bytes = max_prompt_bytes
        self.tokenizer_pool = tokenizer_pool
        self.admission = Admission()
        self.heap = HeapTrimmer()

    def _pool(self) -> WorkerConfig:
        pool = self.view.pool
        if pool is None:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "no worker has registered yet")
        return pool

    async def _tokenize(self, request) -> tuple[str, list[int]]:
        """The request's input form and prompt token ids; sizes are checked before any
        tokenizer work, which runs on the bounded pool (token ids need none). A large request
        has the heap trimmed after it (:mod:`gateway.heap`)."""
        size = request.ByteSize()
        self.heap.request_arrived(size)
        check_request_size(size, self.max_request_bytes)
        which = check_input(request)
        check_prompt_bytes(request, which, self.max_prompt_bytes)
        if which == "token_ids":
            return which, render_prompt(request, which, self.model.tokenizer)
        return which, await self.tokenizer_pool.run(render_prompt, request, which, self.model.tokenizer)

    async def serve_request(self, request: gateway_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                            on_prompt: Callable[[int], None] | None = None) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The request path every public API shares (``tandem.v1.Gateway`` and KServe v2): the
        checks, tokenization and orchestration of one Generate request, with its log lines and
        metrics; the responses are streamed.

        Args:
            request: as the client sent it, or as a protocol adapter translated it.
            time_remaining: seconds until the client's deadline (``None``: none).
            on_prompt: called with the prompt's token count once it is checked, before routing.

        Raises:
            StatusError: the status the client gets (``INTERNAL`` for an unexpected error,
                which is logged).
        """
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        status = grpc.StatusCode.OK
        metrics.IN_FLIGHT.inc()
        try:
            check_request_id(request_id, REQUEST_ID_MAX_CHARS)  # before it is written in a log line
            request_id_var.set(request_id)
            tenant = tenant_var.get()
            tracing.annotate({"tandem.request_id": request_id, "tandem.tenant": tenant.name if tenant else "-"})
            self.admission.check()
            with self.admission.track():
                with tracing.span("validate_and_tokenize") as validated:
                    which, prompt = await self._tokenize(request)
                    pool = self._pool()
                    check_prompt_ids(input_field(which), prompt, pool.max_model_len, pool.vocab_size)
                    if on_prompt is not None:
                        on_prompt(len(prompt))
                    params = sampling_params_from_proto(request.sampling, len(prompt), pool, self.limits)
                    slo = check_service_level(request)
                    if params.stop and self.model.tokenizer is None:
                        raise StatusError.invalid_argument("sampling.stop", "this model has no tokenizer to match text")
                    tracing.annotate({"tandem.prompt_tokens": len(prompt), "tandem.n": params.n,
                                      "tandem.max_tokens": params.max_tokens}, validated)
                logger.info("generate: %d prompt tokens, n=%d, max_tokens=%d, tenant %s", len(prompt), params.n,
                            params.max_tokens, tenant.name if tenant else "-")
                stream = self.orchestrator.run(request_id, prompt, request.sampling, params, pool, time_remaining,
                                               cache_salt=tenant.name if tenant else "", slo=slo)
                async with contextlib.aclosing(stream):
                    async for response in stream:
                        yield response
        except StatusError as exc:
            status = exc.code
            logger.info("generate failed: %s %s", exc.code.name, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # gRPC cancels the call both when the client goes and when its deadline passes; the
            # client's own timer often fires first and its RST_STREAM arrives a little early.
            left = time_remaining()
            status = (grpc.StatusCode.DEADLINE_EXCEEDED if left is not None and left <= _DEADLINE_SLACK_S
                      else grpc.StatusCode.CANCELLED)
            logger.info("client %s", "deadline passed" if status == grpc.StatusCode.DEADLINE_EXCEEDED else "cancelled")
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            logger.exception("generate failed")
            raise StatusError(status, "internal error (see the gateway log)") from None
        finally:
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(status.name).inc()
            metrics.E2E.observe(time.monotonic() - started)
            if status == grpc.StatusCode.OK:
                logger.info("generate done in %.3f s", time.monotonic() - started)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        try:
            async with contextlib.aclosing(self.serve_request(request, context.time_remaining)) as responses:
                async for response in responses:
                    await context.write(response)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:  # noqa: N802
        try:
            _, ids = await self._tokenize(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        return gateway_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context) -> gateway_pb2.ModelInfo:  # noqa: N802
        try:
            pool = self._pool()
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        return gateway_pb2.ModelInfo(model_id=self.model.model_id, max_model_len=pool.max_model_len,
                                     block_size=pool.block_size, vocab_size=pool.vocab_size)


class Gateway:
    """The gateway process' parts, built by :meth:`start` and torn down by :meth:`stop`.

    Args:
        settings: the gateway's settings.
        model: the served model (default: resolved from ``settings.model``).
    """

    def __init__(self, settings: GatewaySettings, model: ServedModel | None = None) -> None:
        self.settings = settings
        self.model = model or load_served_model(settings)
        self.port: int | None = None
        self._tls = (ClientCredentials(settings.tls_dir, "gateway", setting_name(GatewaySettings, "tls_dir"))
                     if settings.tls_dir else None)
        # With TLS a worker must show a certificate of the role its registry entry claims.
        options = [*_WORKER_CHANNEL_OPTIONS, *client_keepalive_options(settings.keepalive_time_s,
                                                                       settings.keepalive_timeout_s)]
        self._channels = ChannelCache(options, self._tls, peer_name=role_name("decode"))
        self._prefill_channels = ChannelCache(options, self._tls, peer_name=role_name("prefill"))
        self._redis = None
        self._clients = clients = WorkerClients(self._channels, self._prefill_channels)
        self.view = self._build_view()
        self.orchestrator = Orchestrator(self.view, clients, self.model.tokenizer,
                                         settings.admit_wait_s, settings.local_prefill_max_tokens,
                                         settings.max_retries, settings.hop_timeout_s, settings.decode_stall_timeout_s,
                                         settings.prefill_timeout_s_per_token,
                                         ServiceLevel(settings.slo_ttft_s, settings.slo_itl_s, settings.slo_tpot_s),
                                         adaptive_placement=settings.prefill_placement == "adaptive")
        self.prober = HealthProber(self.view, clients, settings.health_probe_interval_s,
                                   settings.health_probe_timeout_s)
        self.tokenizer_pool = TokenizerPool(settings.tokenizer_threads, settings.tokenizer_queue)
        self.servicer = GatewayServicer(self.model, self.view, self.orchestrator, settings.limits,
                                        settings.max_request_bytes, settings.max_prompt_bytes, self.tokenizer_pool)
        self._scaffold: ServerScaffold | None = None
        self._loops = [PeriodicTask(self._refresh, settings.refresh_interval_s, "refresh",
                                    first_after_s=settings.refresh_interval_s),
                       PeriodicTask(self.prober.probe_once, self.prober.interval_s, "health-probe")]

    @property
    def health(self):
        """The server's :class:`cluster.health.HealthServicer` (after :meth:`start`)."""
        return self._scaffold.health

    async def start(self) -> int:
        """Bind, start serving (SERVING once the pool can take a request); returns the bound port.

        Raises:
            cluster.server.BindError: the listen address cannot be bound.
            cluster.server.StartupError: neither TLS nor ``insecure`` is set, the TLS files
                cannot be read, or no API key protects a non-loopback address (``allow_open``).
        """
        s = self.settings
        try:
            s.check_transport_security()
            s.check_open_access()
            credentials = (server_credentials(s.tls_dir, "gateway", False, setting_name(GatewaySettings, "tls_dir"))
                           if self._tls else None)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # gRPC's own limit sits above max_request_bytes so that a request between the two gets
        # INVALID_ARGUMENT naming "request" (larger ones: RESOURCE_EXHAUSTED from gRPC itself).
        self._scaffold = ServerScaffold([SERVICE_NAME, kserve.SERVICE_NAME], [("grpc.max_receive_message_length", 2 * s.max_request_bytes),
                                                         *server_keepalive_options(s.keepalive_time_s,
                                                                                   s.keepalive_timeout_s)],
                                        reflection=s.reflection, interceptors=self._auth(), new_traces=True)
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, self._scaffold.server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(kserve.KServeServicer(self.servicer),
                                                                         self._scaffold.server)
        self.port = self._scaffold.bind(s.listen, setting_name(GatewaySettings, "listen"), credentials)
        if s.health_port:
            self._scaffold.serve_probes(s.listen_host, s.health_port, setting_name(GatewaySettings, "health_port"))
        if self._tls is None:
            logger.warning("insecure: the API and the worker channels are plaintext (no %s)",
                           setting_name(GatewaySettings, "tls_dir"))
        await self._scaffold.start()
        await self._refresh()
        for loop in self._loops:
            loop.start()
        logger.info("listening on %s:%d (model %s, %s)", s.listen_host, self.port, self.model.model_id,
                    f"redis {s.redis_url}" if s.redis_url else f"static workers {s.static_prefill}+{s.static_decode}")
        return self.port

    def _auth(self) -> list[AuthInterceptor]:
        keys = self.settings.load_api_keys()
        if not keys:
            logger.warning("no API keys configured: the gateway is open to every caller, as one tenant")
            return []
        logger.info("%d API keys: calls without one are UNAUTHENTICATED", len(keys))
        return [AuthInterceptor(keys)]

    def _build_view(self) -> ClusterView:
        s = self.settings
        ns = ClusterNamespace(s.redis_key_prefix, s.registry_ttl_s)
        outliers = OutlierDetector(s.outlier_consecutive_failures, s.outlier_base_ejection_s,
                                   s.outlier_max_ejection_s)
        if s.redis_url:
            from cluster.prefix_index import PrefixIndex

            from gateway.static_cluster import probe_load

            self._redis = redis_client(s.redis_url, password=s.redis_password, tls_ca=s.redis_tls_ca)
            return ClusterView(WorkerRegistry(self._redis, ns), PrefixIndex(self._redis, ns), self.model.model_id,
                               outliers=outliers, load_probe=functools.partial(probe_load, self._clients))
        from gateway.static_cluster import RoutedPrefixIndex, StaticRegistry

        logger.warning("no Redis configured: static workers prefill=%s decode=%s, in-process prefix index "
                       "built from this gateway's own routing", s.static_prefill, s.static_decode)
        registry = StaticRegistry(self._clients,
                                  {Role.PREFILL: s.static_prefill, Role.DECODE: s.static_decode}, ns)
        return ClusterView(registry, RoutedPrefixIndex(), self.model.model_id, outliers=outliers)

    async def _refresh(self) -> None:
        """Re-read the pool; SERVING exactly while a request can be routed."""
        await self.view.refresh()
        await self.health.set_all(SERVING if self.view.routable else NOT_SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING and health watches ended, new calls refused (UNAVAILABLE), in-flight ones
        given ``grace_s`` (default ``drain_timeout_s``) to finish, then everything closed."""
        grace_s = self.settings.drain_timeout_s if grace_s is None else grace_s
        await shutdown_step("health NOT_SERVING", self.health.shutdown())
        self.servicer.admission.open = False
        await shutdown_step("stopping the refresh and the health probe",
                            asyncio.gather(*(loop.stop() for loop in self._loops)))
        await self.servicer.admission.wait_idle(grace_s)
        await shutdown_step("stopping the gRPC server", self._scaffold.stop(0.5))
        await shutdown_step("sending the last Aborts", self.orchestrator.drain_aborts())
        self.tokenizer_pool.close()
        await shutdown_step("closing decode channels", self._channels.close())
        await shutdown_step("closing prefill channels", self._prefill_channels.close())
        if self._redis is not None:
            await shutdown_step("closing the Redis client", self._redis.aclose())


async def serve(settings: GatewaySettings) -> None:
    """Run the gateway until SIGTERM or SIGINT, then drain and return.

    Raises:
        cluster.server.BindError: the listen address or the metrics port cannot be bound.
    """
    return_large_buffers_to_the_os()
    if tracing.configure("tandem-gateway"):  # before the channels and the server are built
        logger.info("OpenTelemetry tracing on (OTLP)")
    gateway = Gateway(settings)
    if settings.metrics_port:
        from prometheus_client import REGISTRY

        serve_metrics(REGISTRY, settings.listen_host, settings.metrics_port, setting_name(GatewaySettings, "metrics_port"))
        logger.info("metrics on %s:%d/metrics", settings.listen_host, settings.metrics_port)
    await gateway.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    logger.info("shutting down: NOT_SERVING, draining in-flight requests (at most %.0f s)", settings.drain_timeout_s)
    exit_if_shutdown_hangs(settings.drain_timeout_s)
    await gateway.stop()
    tracing.shutdown()
    logger.info("stopped")
