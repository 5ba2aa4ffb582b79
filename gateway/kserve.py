"""KServe v2 (``inference.GRPCInferenceService``, the Open Inference Protocol as Triton defines
it) beside ``tandem.v1.Gateway``: a thin adapter over the shared request path.

A request is translated (:mod:`gateway.kserve_io`) into a native ``GenerateRequest`` and runs
through :meth:`gateway.frontend.FrontEnd.respond`: the same validation, limits,
tenants (API keys, checked by the server's interceptor for every method), orchestration and
metrics; its refusals name the KServe input (``text_input``, ``sampling_parameters.X``).
``ModelInfer`` answers one whole response; ``ModelStreamInfer`` is decoupled as in
Triton: each request on the stream runs on its own, with ``stream`` true one response per
step, the last carrying the ``triton_final_response`` parameter true (or, when the request sets
``triton_enable_empty_final_response``, an empty response after it does); a request's error
is a response with ``error_message`` (``CODE: message``) and the stream goes on; closing the
stream cancels its requests (their KV blocks are freed). One model is served, named as
``GetModelInfo`` names it, version ``1``; repository load and unload are UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version

import grpc

from gateway import kserve_io
from gateway.auth import tenant_var
from gateway.frontend import FrontEnd, renamed
from gateway.kserve_io import INPUTS, OUTPUTS, InferRequest
from gateway.vllm_params import STRUCTURED_OUTPUTS
from protos.inference import grpc_service_pb2 as kserve, grpc_service_pb2_grpc, model_config_pb2
from protos.status import StatusError

SERVICE_NAME = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_VERSION = "1"
_CONFIG_TYPES = {"BYTES": model_config_pb2.TYPE_STRING, "BOOL": model_config_pb2.TYPE_BOOL,
                 "UINT32": model_config_pb2.TYPE_UINT32}
# The native field an error names → the KServe input it came from.
_KSERVE_NAMES = {"prompt": "text_input",
                 **{f"sampling.{native}": f"sampling_parameters.structured_outputs.{kind}"
                    for kind, native in STRUCTURED_OUTPUTS.items()},
                 "sampling.": "sampling_parameters."}


def _server_version() -> str:
    try:
        return version("tandem-serve")
    except PackageNotFoundError:
        return "unknown"


class _Statistics:
    """What ``ModelStatistics`` reports: requests that succeeded and failed, with their time."""

    def __init__(self) -> None:
        self.success = kserve.StatisticDuration()
        self.fail = kserve.StatisticDuration()
        self.last_inference_ms = 0

    def record(self, ok: bool, started_ns: int) -> None:
        duration = self.success if ok else self.fail
        duration.count += 1
        duration.ns += time.monotonic_ns() - started_ns
        self.last_inference_ms = int(time.time() * 1000)

    def proto(self, name: str) -> kserve.ModelStatistics:
        count = self.success.count + self.fail.count
        return kserve.ModelStatistics(name=name, version=MODEL_VERSION, last_inference=self.last_inference_ms,
                                      inference_count=count, execution_count=count,
                                      inference_stats=kserve.InferStatistics(success=self.success, fail=self.fail))


class KServeServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService`` over the gateway's shared request path (module docstring).

    Args:
        frontend: the request path every inference takes.
    """

    def __init__(self, frontend: FrontEnd) -> None:
        self.frontend = frontend
        self.statistics = _Statistics()

    @property
    def model_name(self) -> str:
        """The served model's name (``GetModelInfo``'s ``model_id``)."""
        return self.frontend.model.model_id

    def _check_model(self, name: str, model_version: str) -> None:
        if name != self.model_name:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"model_name: unknown model {name!r} (this gateway serves "
                                                         f"{self.model_name!r})")
        if model_version not in ("", MODEL_VERSION):
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"model_version: {self.model_name} has only version "
                                                         f"{MODEL_VERSION}, not {model_version!r}")

    # -- health and metadata -------------------------------------------------------------

    async def ServerLive(self, request, context) -> kserve.ServerLiveResponse:  # noqa: N802
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> kserve.ServerReadyResponse:  # noqa: N802
        return kserve.ServerReadyResponse(ready=self.frontend.routable)

    async def ModelReady(self, request, context) -> kserve.ModelReadyResponse:  # noqa: N802
        known = request.name == self.model_name and request.version in ("", MODEL_VERSION)
        return kserve.ModelReadyResponse(ready=known and self.frontend.routable)

    async def ServerMetadata(self, request, context) -> kserve.ServerMetadataResponse:  # noqa: N802
        return kserve.ServerMetadataResponse(name="tandem", version=_server_version())

    async def ModelMetadata(self, request, context) -> kserve.ModelMetadataResponse:  # noqa: N802
        await self._or_abort(context, self._check_model, request.name, request.version)
        tensor = kserve.ModelMetadataResponse.TensorMetadata
        return kserve.ModelMetadataResponse(
            name=self.model_name, versions=[MODEL_VERSION], platform="tandem",
            inputs=[tensor(name=name, datatype=datatype, shape=[1]) for name, (datatype, _) in INPUTS.items()],
            outputs=[tensor(name=name, datatype=datatype, shape=shape) for name, (datatype, shape) in OUTPUTS.items()])

    async def ModelConfig(self, request, context) -> kserve.ModelConfigResponse:  # noqa: N802
        await self._or_abort(context, self._check_model, request.name, request.version)
        config = model_config_pb2.ModelConfig(
            name=self.model_name, platform="tandem", backend="tandem", max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=name, data_type=_CONFIG_TYPES[datatype], dims=[1],
                                               optional=not required)
                   for name, (datatype, required) in INPUTS.items()],
            output=[model_config_pb2.ModelOutput(name=name, data_type=_CONFIG_TYPES[datatype], dims=shape)
                    for name, (datatype, shape) in OUTPUTS.items()],
            model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True))
        return kserve.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context) -> kserve.ModelStatisticsResponse:  # noqa: N802
        if request.name:
            await self._or_abort(context, self._check_model, request.name, request.version)
        return kserve.ModelStatisticsResponse(model_stats=[self.statistics.proto(self.model_name)])

    async def RepositoryIndex(self, request, context) -> kserve.RepositoryIndexResponse:  # noqa: N802
        ready = self.frontend.routable
        return kserve.RepositoryIndexResponse(models=[kserve.RepositoryIndexResponse.ModelIndex(
            name=self.model_name, version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE",
            reason="" if ready else "no worker can serve a request")])

    # -- inference -----------------------------------------------------------------------

    async def ModelInfer(self, request, context) -> kserve.ModelInferResponse:  # noqa: N802
        started = time.monotonic_ns()
        try:
            infer = self._translate(request)
            if infer.stream:
                raise StatusError.invalid_argument("stream", "ModelInfer answers once; stream with ModelStreamInfer")
            response = await self._whole(request, infer, context.time_remaining)
        except StatusError as exc:
            self.statistics.record(False, started)
            exc = renamed(exc, _KSERVE_NAMES)
            await context.abort(exc.code, exc.message)
        self.statistics.record(True, started)
        return response

    async def ModelStreamInfer(self, request_iterator, context) -> None:  # noqa: N802
        lock = asyncio.Lock()

        async def write(response: kserve.ModelStreamInferResponse) -> None:
            async with lock:  # the stream's requests run concurrently; their messages go out one at a time
                await context.write(response)

        async with asyncio.TaskGroup() as requests:
            async for request in request_iterator:
                requests.create_task(self._streamed(request, context.time_remaining, write))

    async def _streamed(self, request: kserve.ModelInferRequest, time_remaining,
                        write: Callable[[kserve.ModelStreamInferResponse], Awaitable[None]]) -> None:
        """Serve one request of a ``ModelStreamInfer`` stream (its failure is a message of the stream)."""
        started = time.monotonic_ns()
        try:
            infer = self._translate(request)
            empty_final = kserve_io.wants_empty_final_response(request)
            if infer.stream:
                async for response in self._steps(request, infer, time_remaining, empty_final):
                    await write(kserve.ModelStreamInferResponse(infer_response=response))
            else:
                response = await self._whole(request, infer, time_remaining)
                response.parameters["triton_final_response"].bool_param = not empty_final
                await write(kserve.ModelStreamInferResponse(infer_response=response))
            if empty_final:
                await write(kserve.ModelStreamInferResponse(
                    infer_response=kserve_io.empty_final_response(request, self.model_name)))
        except StatusError as exc:
            self.statistics.record(False, started)
            exc = renamed(exc, _KSERVE_NAMES)
            await write(kserve.ModelStreamInferResponse(
                error_message=f"{exc.code.name}: {exc.message}",
                infer_response=kserve.ModelInferResponse(model_name=self.model_name, id=request.id)))
            return
        self.statistics.record(True, started)

    def _translate(self, request: kserve.ModelInferRequest) -> InferRequest:
        self._check_model(request.model_name, request.model_version)
        return kserve_io.infer_request(request)

    async def _steps(self, request, infer: InferRequest, time_remaining,
                     empty_final: bool) -> AsyncIterator[kserve.ModelInferResponse]:
        """One response per native message: its new text and new tokens."""
        prompt_tokens = 0

        def note(count: int) -> None:
            nonlocal prompt_tokens
            prompt_tokens = count

        async for message in self.frontend.respond(infer.native_request, tenant_var.get(), time_remaining, note):
            last = message.HasField("usage")
            yield kserve_io.infer_response(request, infer, self.model_name, message.text, message.finish_reason,
                                           prompt_tokens, len(message.token_ids), final=last and not empty_final)

    async def _whole(self, request, infer: InferRequest, time_remaining) -> kserve.ModelInferResponse:
        """The whole answer in one response (the prompt first unless ``exclude_input_in_output``)."""
        text, tokens, finish, prompt_tokens = [], 0, 0, 0
        async for message in self.frontend.respond(infer.native_request, tenant_var.get(), time_remaining):
            text.append(message.text)
            tokens += len(message.token_ids)
            finish = message.finish_reason or finish
            if message.HasField("usage"):
                prompt_tokens = message.usage.prompt_tokens
        prefix = "" if infer.exclude_input else infer.native_request.prompt
        return kserve_io.infer_response(request, infer, self.model_name, prefix + "".join(text), finish,
                                        prompt_tokens, tokens)

    @staticmethod
    async def _or_abort(context, check: Callable, *args) -> None:
        try:
            check(*args)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
