"""A worker's request RPCs (``Prefill``, ``Decode``) answer each failure with its gRPC status and
count it by status: served by a real grpc.aio server on loopback, a unary handler and a
streaming one, as the prefill and decode workers use ``cluster.worker.request_outcome``."""

import asyncio

import grpc
import pytest

from cluster.metrics import WorkerMetrics
from cluster.worker import request_outcome
from engine.core.core_client import EngineDeadError, EngineError
from engine.outputs import EngineStats
from protos.status import StatusError
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc

# request_id -> what the handler raises before its first answer
FAILURES = {
    "bad": StatusError.invalid_argument("prompt_token_ids", "is empty"),
    "dead": EngineDeadError("a tensor-parallel rank died"),
    "broken": EngineError("a step raised"),
}


async def _fail_or_wait(request_id: str, entered: asyncio.Event) -> None:
    if request_id in FAILURES:
        raise FAILURES[request_id]
    if request_id == "hang":
        entered.set()
        await asyncio.Event().wait()  # until the caller cancels


class Servicer(worker_pb2_grpc.PrefillWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics, self.entered = metrics, asyncio.Event()

    async def Prefill(self, request, context):  # noqa: N802
        async with request_outcome("Prefill", self.metrics, context) as start:
            assert start > 0
            await _fail_or_wait(request.request_id, self.entered)
            return worker_pb2.PrefillResponse(kv_transport="grpc")

    async def Decode(self, request, context):  # noqa: N802
        async with request_outcome("Decode", self.metrics, context):
            await _fail_or_wait(request.request_id, self.entered)
            yield worker_pb2.DecodeResponse()
            yield worker_pb2.DecodeResponse()


@pytest.mark.parametrize("method", ["Prefill", "Decode"])
def test_each_failure_gets_its_status_and_is_counted_by_it(method: str) -> None:
    metrics = WorkerMetrics("test", EngineStats)

    async def scenario() -> dict[str, str]:
        servicer = Servicer(metrics)
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                prefill = worker_pb2_grpc.PrefillWorkerStub(channel).Prefill
                decode = worker_pb2_grpc.DecodeWorkerStub(channel).Decode

                async def call(request_id: str) -> None:
                    if method == "Prefill":
                        await prefill(worker_pb2.PrefillRequest(request_id=request_id))
                    else:
                        assert len([r async for r in decode(worker_pb2.DecodeRequest(request_id=request_id))]) == 2

                for request_id in ["ok", *FAILURES]:
                    try:
                        await call(request_id)
                        codes[request_id] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        codes[request_id] = exc.code().name
                        failure = FAILURES[request_id]
                        assert exc.details() == (failure.message if isinstance(failure, StatusError) else str(failure))
                hanging = asyncio.ensure_future(call("hang"))
                await asyncio.wait_for(servicer.entered.wait(), 10)
                hanging.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await hanging
                for _ in range(500):  # the server sees the cancellation shortly after
                    if metrics.registry.get_sample_value("tandem_requests_total",
                                                         {"method": method, "status": "CANCELLED"}):
                        break
                    await asyncio.sleep(0.01)
        finally:
            await server.stop(None)
        return codes

    codes = asyncio.run(scenario())
    assert codes == {"ok": "OK", "bad": "INVALID_ARGUMENT", "dead": "UNAVAILABLE", "broken": "INTERNAL"}
    counted = {status: metrics.registry.get_sample_value("tandem_requests_total", {"method": method, "status": status})
               for status in ("OK", "INVALID_ARGUMENT", "UNAVAILABLE", "INTERNAL", "CANCELLED")}
    assert counted == dict.fromkeys(counted, 1.0)
    assert metrics.registry.get_sample_value("tandem_request_latency_seconds_count", {"method": method}) == 5
