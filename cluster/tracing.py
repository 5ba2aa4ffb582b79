"""OpenTelemetry traces of one request across the gateway, the prefill worker and the decode worker.

Off unless the standard variable ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and ``OTEL_SDK_DISABLED`` is not ``true``. Off,
nothing of OpenTelemetry is imported, no interceptor is installed, and :func:`span` returns one
shared no-op context manager: the request path pays a function call and a ``None`` test.

On (:func:`configure`, once per process), spans go in batches to the OTLP/gRPC exporter, which
reads the other standard variables itself (headers, certificates, timeout, ``OTEL_BSP_*``);
``OTEL_SERVICE_NAME`` overrides the role's service name. The trace context travels in gRPC
metadata as W3C ``traceparent``/``tracestate``: :func:`client_interceptors` add the current
context to every call on a :class:`cluster.channels.ChannelCache` channel, and
:func:`server_interceptors` continue it in a SERVER span around each call of the server's own
services (named by the method, with ``tandem.request_id`` from the request message where it has
one). An internal server (a worker) traces only calls that arrive with a context, so the
gateway's health probes start no traces; the public one (the gateway) starts one per call.
Propagation is done here rather than by ``opentelemetry-instrumentation-grpc``: a few lines on
the interceptor hook every server already has (:func:`cluster.interceptors.wrap_handler`).

Attributes carry ids, counts, sizes, worker ids and statuses, never prompt or output text.
The tracer is this module's own (no global provider is set), so tests can :func:`enable` an
in-memory exporter and :func:`shutdown` it again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

from cluster.interceptors import wrap_handler

_NO_SPAN = contextlib.nullcontext()
_tracer = None  # an opentelemetry Tracer while tracing is on
_provider = None


def enabled_by_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OpenTelemetry variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service_name: str) -> bool:
    """Turn tracing on for this process when the environment asks for it (see the module
    docstring); returns whether it is on. Call before building servers and channel caches."""
    if _tracer is None and enabled_by_environment():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        enable(service_name, BatchSpanProcessor(OTLPSpanExporter()))
    return _tracer is not None


def enable(service_name: str, processor: Any) -> None:
    """Trace to ``processor`` (an SDK ``SpanProcessor``) under ``service_name``, whatever the
    environment says (tests use an in-memory exporter)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    global _provider, _tracer
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(processor)
    _tracer = _provider.get_tracer("tandem")


def shutdown() -> None:
    """Export what is buffered and turn tracing off (no-op while off)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


def enabled() -> bool:
    return _tracer is not None


def span(name: str, attributes: Mapping[str, Any] | None = None):
    """A context manager: a span named ``name``, the current one inside, ended at exit; it
    yields the span, or ``None`` while tracing is off. An exception marks it ERROR, described by
    its message alone (OpenTelemetry's default puts the class name first, internal classes
    included); its type and traceback are in the span's exception event."""
    if _tracer is None:
        return _NO_SPAN
    return _described(_tracer.start_as_current_span(name, attributes=attributes, set_status_on_exception=False))


@contextlib.contextmanager
def _described(started):
    from opentelemetry.trace import Status, StatusCode

    with started as current:
        try:
            yield current
        except Exception as exc:
            current.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))
            raise


def annotate(attributes: Mapping[str, Any], target=None) -> None:
    """Set ``attributes`` on ``target`` (default: the current span); no-op while off."""
    if _tracer is None:
        return
    from opentelemetry import trace

    (target or trace.get_current_span()).set_attributes(attributes)


def current_context():
    """The current trace context, for :func:`record`'s ``parent`` (``None`` while off)."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def record(name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any], parent=None) -> None:
    """A finished span that ran from ``start_ns`` to ``end_ns`` (``time.time_ns()``), a child
    of ``parent`` (from :func:`current_context`; default: the current span); no-op while off."""
    if _tracer is None:
        return
    _tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns).end(end_time=end_ns)


# ---------------------------------------------------------------------------- propagation
def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    if not carrier:  # no span is current: nothing to carry
        return details
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *carrier.items()))


# grpc.aio files a client interceptor under the first of the four kinds it is an instance of:
# one class per kind. grpc.aio runs an interceptor in a task made at the call, so it sees the
# caller's context.
class _UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    """Puts the caller's trace context into a unary call's metadata."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    """Puts the caller's trace context into a response-streaming call's metadata."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnaryTracing(grpc.aio.StreamUnaryClientInterceptor):
    """Puts the caller's trace context into a request-streaming call's metadata."""

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStreamTracing(grpc.aio.StreamStreamClientInterceptor):
    """Puts the caller's trace context into a bidirectional call's metadata."""

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """The interceptors of a client channel: none while tracing is off."""
    if _tracer is None:
        return []
    return [_UnaryUnaryTracing(), _UnaryStreamTracing(), _StreamUnaryTracing(), _StreamStreamTracing()]


class _ServerTracing(grpc.aio.ServerInterceptor):
    """A SERVER span around each call of ``services`` (see :func:`server_interceptors`)."""

    def __init__(self, services: Iterable[str], new_traces: bool) -> None:
        self.services = frozenset(services)
        self.new_traces = new_traces

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method.lstrip("/")
        metadata = {key: value for key, value in (handler_call_details.invocation_metadata or ())
                    if isinstance(value, str)}
        if handler is None or method.split("/")[0] not in self.services \
                or not (self.new_traces or "traceparent" in metadata):
            return handler
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        @contextlib.asynccontextmanager
        async def scope(context: grpc.aio.ServicerContext):
            # The call's status describes the span, not the exception ``context.abort`` raises
            # to end it (``AbortError: Locally aborted.``); another exception describes it itself.
            with _tracer.start_as_current_span(method, context=extract(metadata), kind=SpanKind.SERVER,
                                               attributes={"rpc.system": "grpc", "rpc.method": method},
                                               set_status_on_exception=False) as server_span:
                escaped = None
                try:
                    yield
                except BaseException as exc:
                    escaped = exc
                    raise
                finally:
                    code = context.code()
                    if code is not None and code != grpc.StatusCode.OK:
                        server_span.set_attribute("rpc.grpc.status_code", code.value[0])
                        server_span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))
                    elif isinstance(escaped, Exception):
                        server_span.set_status(Status(StatusCode.ERROR, str(escaped) or type(escaped).__name__))

        return wrap_handler(handler, scope=scope, check=_note_request_id)


async def _note_request_id(message: Any, context: grpc.aio.ServicerContext) -> None:
    request_id = getattr(message, "request_id", "")
    if request_id:
        annotate({"tandem.request_id": request_id})


def server_interceptors(services: Sequence[str], new_traces: bool) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a server of ``services`` (its own, not health or reflection): none
    while tracing is off. ``new_traces``: start a trace for a call that carries none (the
    public gateway); otherwise only calls with a context are traced."""
    return [] if _tracer is None else [_ServerTracing(services, new_traces)]
