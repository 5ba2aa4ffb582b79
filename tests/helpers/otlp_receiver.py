"""A minimal OTLP/gRPC trace receiver for the tests: the collector's own
``opentelemetry.proto.collector.trace.v1.TraceService`` on a loopback port, keeping every span it
is sent with the ``service.name`` of the process that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: ids as hex (``parent_id`` empty for a root), its name, the sending
    process's ``service.name``, its string and integer attributes, and its status (``status``:
    ``UNSET``, ``OK`` or ``ERROR``; ``status_message``: the description of an ERROR)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    attributes: dict
    status: str
    status_message: str


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Serves ``TraceService.Export`` on ``127.0.0.1:<port>`` while entered (``endpoint``: the
    value for ``OTEL_EXPORTER_OTLP_ENDPOINT``)."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):  # noqa: N802
        received = []
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                    status = trace_pb2.Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_")
                    received.append(ReceivedSpan(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                                                 span.name, service, attributes, status, span.status.message))
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done, timeout_s: float) -> list[ReceivedSpan]:
        """Poll until ``done(spans)`` holds or ``timeout_s`` passes; the spans received by then."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return spans

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(0)
