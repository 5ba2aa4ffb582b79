"""The public gRPC endpoint: ``tandem.v1.Gateway`` and KServe v2 (:mod:`gateway.kserve`), with
OpenAI's HTTP API on a port of its own (:mod:`gateway.openai_api`), plus health, reflection
and /metrics.

Each API is a thin adapter over the shared request path (:mod:`gateway.frontend`):
:class:`GatewayServicer` hands ``Generate`` requests to it as they come; statuses map as
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
import ipaddress
import logging
import signal

import grpc

from cluster import tracing
from cluster.channels import ChannelCache, client_keepalive_options, server_keepalive_options
from cluster.health import NOT_SERVING, SERVING
from cluster.identity import InstanceVerifier
from cluster.periodic import PeriodicTask
from cluster.registry import ClusterNamespace, Role, WorkerRegistry, redis_client
from cluster.server import ServerScaffold, StartupError, serve_metrics
from cluster.settings import setting_name
from cluster.shutdown import exit_if_shutdown_hangs, shutdown_step
from cluster.tls import ClientCredentials, role_name, server_credentials, server_ssl_context
from gateway import kserve
from gateway.auth import AuthInterceptor, TenantGate, tenant_var
from gateway.frontend import FrontEnd
from gateway.heap import return_large_buffers_to_the_os
from gateway.orchestrator import Orchestrator
from gateway.outlier import OutlierDetector
from gateway.placement import ServiceLevel
from gateway.prober import HealthProber
from gateway.request import Intake
from gateway.quarantine import Quarantine
from gateway.router import ClusterView
from gateway.served_model import ServedModel, load_served_model
from gateway.settings import GatewaySettings
from gateway.tokenizer_pool import TokenizerPool
from gateway.worker_calls import WorkerClients
from protos.status import StatusError
from protos.inference import grpc_service_pb2_grpc
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

__all__ = ["SERVICE_NAME", "Gateway", "GatewayServicer", "ServedModel", "load_served_model", "serve"]

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# Worker channels carry the KV-free control plane only; prompts of max_model_len ids fit easily.
_WORKER_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                           ("grpc.max_send_message_length", 64 << 20)]


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """``tandem.v1.Gateway`` over the shared request path; the caller's tenant is the auth
    interceptor's (:data:`gateway.auth.tenant_var`).

    Args:
        frontend: the request path.
    """

    def __init__(self, frontend: FrontEnd) -> None:
        self.frontend = frontend

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        try:
            responses = self.frontend.respond(request, tenant_var.get(), context.time_remaining)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    await context.write(response)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)

    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:  # noqa: N802
        try:
            _, ids = await self.frontend.intake.tokenize(request)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        return gateway_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context) -> gateway_pb2.ModelInfo:  # noqa: N802
        try:
            pool = self.frontend.intake.pool()
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
        return gateway_pb2.ModelInfo(model_id=self.frontend.model.model_id, max_model_len=pool.max_model_len,
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
        self.http_port: int | None = None  # the OpenAI-compatible HTTP API's, once started
        self._http = None  # gateway.http_server.HttpServer, once started
        self.gate = self._tenant_gate()
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
        self.orchestrator = Orchestrator(self.view, clients, settings.admit_wait_s, settings.local_prefill_max_tokens,
                                         settings.max_retries, settings.hop_timeout_s, settings.decode_stall_timeout_s,
                                         settings.prefill_timeout_s_per_token,
                                         adaptive_placement=settings.prefill_placement == "adaptive")
        self.prober = HealthProber(self.view, clients, settings.health_probe_interval_s,
                                   settings.health_probe_timeout_s)
        self.tokenizer_pool = TokenizerPool(settings.tokenizer_threads, settings.tokenizer_queue)
        intake = Intake(self.model, self.view, settings.limits, settings.max_request_bytes, settings.max_prompt_bytes,
                        self.tokenizer_pool, ServiceLevel(settings.slo_ttft_s, settings.slo_itl_s, settings.slo_tpot_s))
        self.frontend = FrontEnd(intake, self.orchestrator)
        self.servicer = GatewayServicer(self.frontend)
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
            http = self._http_server() if s.http_addr else None
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # gRPC's own limit sits above max_request_bytes so that a request between the two gets
        # INVALID_ARGUMENT naming "request" (larger ones: RESOURCE_EXHAUSTED from gRPC itself).
        options = [("grpc.max_receive_message_length", 2 * s.max_request_bytes),
                   *server_keepalive_options(s.keepalive_time_s, s.keepalive_timeout_s)]
        self._scaffold = ServerScaffold([SERVICE_NAME, kserve.SERVICE_NAME], options, reflection=s.reflection,
                                        interceptors=[AuthInterceptor(self.gate)] if self.gate else [],
                                        new_traces=True)
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.servicer, self._scaffold.server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(kserve.KServeServicer(self.frontend),
                                                                         self._scaffold.server)
        self.port = self._scaffold.bind(s.listen, setting_name(GatewaySettings, "listen"), credentials)
        if s.health_port:
            self._scaffold.serve_probes(s.listen_host, s.health_port, setting_name(GatewaySettings, "health_port"))
        if self._tls is None:
            logger.warning("insecure: the API and the worker channels are plaintext (no %s)",
                           setting_name(GatewaySettings, "tls_dir"))
        await self._scaffold.start()
        if http is not None:
            self.http_port = await http.start()
            self._http = http
            logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if self._tls else "http",
                        s.http_addr.rpartition(":")[0].strip("[]"), self.http_port)
        await self._refresh()
        for loop in self._loops:
            loop.start()
        logger.info("listening on %s:%d (model %s, %s)", s.listen_host, self.port, self.model.model_id,
                    f"redis {s.redis_url}" if s.redis_url else f"static workers {s.static_prefill}+{s.static_decode}")
        return self.port

    def _http_server(self):
        """The OpenAI-compatible HTTP server, with the gRPC port's TLS and API keys (FastAPI and
        uvicorn are imported here: a gateway without the HTTP API never loads them).

        Raises:
            ValueError: no API key protects a non-loopback ``http_addr`` (``allow_open``), or
                the TLS files cannot be read.
        """
        from gateway.http_server import HttpServer
        from gateway.openai_api import OpenAIApi

        s = self.settings
        host = s.http_addr.rpartition(":")[0].strip("[]")
        if self.gate is None and not s.allow_open and not _is_loopback(host):
            raise ValueError(f"{setting_name(GatewaySettings, 'http_addr')} is {s.http_addr} (not loopback) and no "
                             f"API key is set: set {setting_name(GatewaySettings, 'api_keys')} or serve everyone "
                             f"with {setting_name(GatewaySettings, 'allow_open')}")
        context = (server_ssl_context(s.tls_dir, "gateway", setting_name(GatewaySettings, "tls_dir"))
                   if self._tls else None)
        api = OpenAIApi(self.frontend, self.gate, s.max_request_bytes)
        return HttpServer(api.app, s.http_addr, setting_name(GatewaySettings, "http_addr"), context)

    def _tenant_gate(self) -> TenantGate | None:
        keys = self.settings.load_api_keys()
        if not keys:
            logger.warning("no API keys configured: the gateway is open to every caller, as one tenant")
            return None
        logger.info("%d API keys: calls without one are UNAUTHENTICATED", len(keys))
        return TenantGate(keys)

    def _build_view(self) -> ClusterView:
        s = self.settings
        ns = ClusterNamespace(s.redis_key_prefix, s.registry_ttl_s)
        outliers = OutlierDetector(s.outlier_consecutive_failures, s.outlier_base_ejection_s,
                                   s.outlier_max_ejection_s)
        if s.redis_url:
            from cluster.prefix_index import PrefixIndex

            from gateway.static_cluster import probe_load

            self._redis = redis_client(s.redis_url, password=s.redis_password, tls_ca=s.redis_tls_ca)
            # Under TLS a registry entry is routed to only if the certificate on its address names it.
            identity = InstanceVerifier(s.tls_dir, "gateway").refusal if s.tls_dir else None
            return ClusterView(WorkerRegistry(self._redis, ns), PrefixIndex(self._redis, ns), self.model.model_id,
                               outliers=outliers, load_probe=functools.partial(probe_load, self._clients),
                               identity=identity, quarantine=Quarantine(self._redis, ns, s.quarantine_s))
        from gateway.static_cluster import RoutedPrefixIndex, StaticRegistry

        logger.warning("no Redis configured: static workers prefill=%s decode=%s, in-process prefix index "
                       "built from this gateway's own routing", s.static_prefill, s.static_decode)
        registry = StaticRegistry(self._clients,
                                  {Role.PREFILL: s.static_prefill, Role.DECODE: s.static_decode}, ns)
        return ClusterView(registry, RoutedPrefixIndex(), self.model.model_id, outliers=outliers,
                           quarantine=Quarantine(None, ns, s.quarantine_s))

    async def _refresh(self) -> None:
        """Re-read the pool; SERVING exactly while a request can be routed."""
        await self.view.refresh()
        await self.health.set_all(SERVING if self.view.routable else NOT_SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING and health watches ended, new calls refused (UNAVAILABLE), in-flight ones
        given ``grace_s`` (default ``drain_timeout_s``) to finish, then everything closed."""
        grace_s = self.settings.drain_timeout_s if grace_s is None else grace_s
        await shutdown_step("health NOT_SERVING", self.health.shutdown())
        self.frontend.admission.open = False
        await shutdown_step("stopping the refresh and the health probe",
                            asyncio.gather(*(loop.stop() for loop in self._loops)))
        await self.frontend.admission.wait_idle(grace_s)
        if self._http is not None:
            await shutdown_step("stopping the HTTP server", self._http.stop(0.5))
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


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
