"""OpenAI's HTTP API on the gateway (FastAPI): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``.

A thin adapter over the shared request path (:mod:`gateway.frontend`): a request body (at most
``max_request_bytes``) is parsed into its pydantic type (:mod:`gateway.openai_models`), mapped
onto a native request (:func:`gateway.openai_io.generate_request`) and served by
:meth:`FrontEnd.respond`, with the same validation, tenants, orchestration and metrics as
tandem.v1 and KServe. API keys are the gRPC port's (:class:`gateway.auth.TenantGate`:
``Authorization: Bearer KEY`` names the tenant, whose cache salt and stream limit apply);
``/health`` is open (200 while a request can be routed, else 503).

Answers: the whole response, or with ``stream: true`` Server-Sent Events (``data: {chunk}``,
one chunk per native message, a usage chunk with ``stream_options.include_usage``, then
``data: [DONE]``). Every failure before the first token is OpenAI's error object with its HTTP
status (:data:`HTTP_STATUS`: 400 naming the field, 401, 404 for another model, 429 when the
decode pool or the tenant is full, 503 when no worker can serve, 504 past the deadline); one
after it is an error event on the stream. A request may set a deadline with the header
``X-Request-Timeout`` (seconds). A client that disconnects cancels its request as a cancelled
gRPC call does: every block it held on the workers is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from cluster.log import request_id_var
from gateway import openai_io
from gateway.auth import Tenant, TenantGate, key_of
from gateway.frontend import FrontEnd, renamed
from gateway.openai_io import Choices, TokenText
from gateway.openai_models import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                   ChatCompletionRequest, Completion, CompletionChoice, CompletionRequest, Delta,
                                   ErrorDetail, ErrorResponse, Model, ModelList, SamplingRequest)
from protos.status import StatusError
from protos.tandem.v1 import gateway_pb2

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
_ERROR_CODES = {401: "invalid_api_key", 404: "model_not_found"}
_CLIENT_CLOSED = 499  # never read: the client has gone


class _ClientGone(Exception):
    """The client disconnected before the response began."""


def error_response(error: StatusError) -> Response:
    """OpenAI's error object for ``error``, with its HTTP status (``param``: the field a 400 names)."""
    status = HTTP_STATUS.get(error.code, 500)
    param = error.message.partition(":")[0] if error.code == grpc.StatusCode.INVALID_ARGUMENT else None
    body = ErrorResponse(error=ErrorDetail(message=error.message, type=_ERROR_TYPES.get(status, "internal_error"),
                                           param=param, code=_ERROR_CODES.get(status)))
    return Response(body.model_dump_json(), status, media_type="application/json")


def _sse(payload: pydantic.BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


class OpenAIApi:
    """The FastAPI application (:attr:`app`) of one gateway.

    Args:
        frontend: the shared request path.
        gate: API keys and tenant limits (``None``: the gateway is open).
        max_request_bytes: a request body's size at most (larger: 400 naming ``request``).
    """

    def __init__(self, frontend: FrontEnd, gate: TenantGate | None, max_request_bytes: int) -> None:
        self.frontend = frontend
        self.gate = gate
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())
        tokenizer = frontend.model.tokenizer
        self.token_text = TokenText(tokenizer.decode if tokenizer is not None
                                    else lambda ids: f"token_id:{ids[0]}")
        # FastAPI's own OpenTelemetry off: the gateway traces requests itself (cluster.tracing).
        app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None,
                      telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})
        app.add_exception_handler(StatusError, lambda request, exc: error_response(exc))
        app.add_exception_handler(HTTPException, lambda request, exc: error_response(
            StatusError(grpc.StatusCode.NOT_FOUND if exc.status_code == 404 else grpc.StatusCode.INVALID_ARGUMENT,
                        f"request: {exc.detail}")))
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        self.app = app

    @property
    def model_id(self) -> str:
        return self.frontend.model.model_id

    # -- endpoints ----------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.frontend.routable:
            return error_response(StatusError(grpc.StatusCode.UNAVAILABLE, "no worker can serve a request"))
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        return Response(ModelList(data=[self._model()]).model_dump_json(), media_type="application/json")

    async def model(self, model: str, request: Request) -> Response:
        self._tenant(request)
        self._check_model(model)
        return Response(self._model().model_dump_json(), media_type="application/json")

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, ChatCompletionRequest, "chatcmpl", openai_io.CHAT_NAMES)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest, "cmpl", openai_io.COMPLETION_NAMES)

    # -- the request path ---------------------------------------------------------------------

    async def _complete(self, request: Request, kind: type[SamplingRequest], id_prefix: str,
                        names: dict[str, str]) -> Response:
        """Serve one completion request of ``kind`` (its native refusals renamed by ``names``)."""
        tenant = self._tenant(request)
        body = await self._parse(request, kind)
        self._check_model(body.model)
        request_id = request.headers.get("x-request-id") or f"{id_prefix}-{uuid.uuid4().hex}"
        generate, renames = openai_io.generate_request(body, request_id)
        names = {**renames, **names}
        deadline = _deadline(request.headers.get("x-request-timeout"))
        slot = contextlib.ExitStack()
        if tenant is not None:
            slot.enter_context(self.gate.admitted(tenant))
        loop = asyncio.get_running_loop()
        time_remaining = (lambda: deadline - loop.time()) if deadline is not None else (lambda: None)
        call = _Call(self.frontend.respond(generate, tenant, time_remaining), slot, names)
        try:
            if body.stream:
                first = await _unless_gone(request, call.next(deadline))
            else:
                choices = await _unless_gone(request, call.whole(body.n, deadline))
        except _ClientGone:
            await call.close()
            return Response(status_code=_CLIENT_CLOSED)
        except BaseException:
            await call.close()
            raise
        if not body.stream:
            await call.close()
            return Response(self._whole(body, request_id, choices).model_dump_json(), media_type="application/json")
        request_id_var.set(request_id)  # checked by now: the stream's log lines carry it
        return StreamingResponse(self._events(body, request_id, first, call, deadline), media_type="text/event-stream",
                                 background=BackgroundTask(call.close))

    def _tenant(self, request: Request) -> Tenant | None:
        return self.gate.tenant(key_of(request.headers.items())) if self.gate is not None else None

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise StatusError(grpc.StatusCode.NOT_FOUND,
                              f"model: the model {model!r} does not exist (this gateway serves {self.model_id!r})")

    def _model(self) -> Model:
        pool = self.frontend.intake.view.pool
        return Model(id=self.model_id, created=self.created, max_model_len=pool.max_model_len if pool else None)

    async def _parse(self, request: Request, kind: type[SamplingRequest]) -> SamplingRequest:
        """The body as ``kind``, read up to ``max_request_bytes``.

        Raises:
            StatusError: ``INVALID_ARGUMENT`` naming ``request`` (too large, not JSON) or the field.
        """
        limit = self.max_request_bytes
        declared = int(request.headers.get("content-length") or 0)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if max(size, declared) > limit:
                raise StatusError.invalid_argument("request", f"is more than the limit of {limit} bytes")
            chunks.append(chunk)
        try:
            return kind.model_validate_json(b"".join(chunks))
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            field = _field(error["loc"])
            raise StatusError.invalid_argument(field, error["msg"]) from None

    # -- responses ----------------------------------------------------------------------------

    def _whole(self, body: SamplingRequest, request_id: str, choices: Choices) -> ChatCompletion | Completion:
        usage = openai_io.usage(choices.usage)
        if isinstance(body, ChatCompletionRequest):
            return ChatCompletion(id=request_id, created=int(time.time()), model=self.model_id, usage=usage, choices=[
                ChatChoice(index=i, message=AssistantMessage(content="".join(c.text)), finish_reason=c.finish_reason,
                           logprobs=self.token_text.chat(c.logprobs) if body.logprobs else None)
                for i, c in enumerate(choices.choices)])
        return Completion(id=request_id, created=int(time.time()), model=self.model_id, usage=usage, choices=[
            CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                             logprobs=self.token_text.completion(c.logprobs, 0) if body.logprobs is not None else None)
            for i, c in enumerate(choices.choices)])

    async def _events(self, body: SamplingRequest, request_id: str, first: gateway_pb2.GenerateResponse,
                      call: _Call, deadline: float | None) -> AsyncIterator[str]:
        """The SSE stream: a chunk per native message, the usage chunk if asked for, ``[DONE]``."""
        chunk = _Chunks(body, request_id, self.model_id, self.token_text)
        usage = None
        try:
            message = first
            while message is not None:
                if (payload := chunk(message)) is not None:
                    yield _sse(payload)
                usage = message.usage if message.HasField("usage") else None
                message = await call.next(deadline)
            if body.stream_options is not None and body.stream_options.include_usage and usage is not None:
                yield _sse(chunk.usage(usage))
        except StatusError as exc:
            error = ErrorResponse(error=ErrorDetail(message=exc.message, type=_ERROR_TYPES.get(
                HTTP_STATUS.get(exc.code, 500), "internal_error")))
            yield _sse(error)
        finally:
            await call.close()
        yield "data: [DONE]\n\n"


class _Call:
    """One request's native stream, its tenant's slot and its errors renamed into OpenAI's
    fields (``names``); :meth:`close` ends both, however the response ended (again: nothing)."""

    def __init__(self, messages: AsyncIterator[gateway_pb2.GenerateResponse], slot: contextlib.ExitStack,
                 names: dict[str, str]) -> None:
        self.messages = messages
        self.slot = slot
        self.names = names

    async def next(self, deadline: float | None) -> gateway_pb2.GenerateResponse | None:
        """The next native message (``None`` at the end).

        Raises:
            StatusError: the request's failure (DEADLINE_EXCEEDED past ``deadline``, a loop time).
        """
        try:
            async with asyncio.timeout_at(deadline):
                return await anext(self.messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline (x-request-timeout) "
                                                                 "passed") from None
        except StatusError as exc:
            raise renamed(exc, self.names) from None

    async def whole(self, n: int, deadline: float | None) -> Choices:
        """Every native message, collected into ``n`` choices."""
        choices = Choices(n)
        while (message := await self.next(deadline)) is not None:
            choices.add(message)
        return choices

    async def close(self) -> None:
        await self.messages.aclose()
        self.slot.close()


class _Chunks:
    """A streamed response's chunks, one per native message (``None``: nothing to send)."""

    def __init__(self, body: SamplingRequest, request_id: str, model_id: str, token_text: TokenText) -> None:
        self.chat = isinstance(body, ChatCompletionRequest)
        self.logprobs = body.logprobs if self.chat else body.logprobs is not None
        self.head = {"id": request_id, "created": int(time.time()), "model": model_id}
        self.token_text = token_text
        self.started: set[int] = set()  # chat choices whose role went out
        self.offsets = [0] * body.n  # completion choices' text so far, in characters

    def __call__(self, message: gateway_pb2.GenerateResponse) -> ChatCompletionChunk | Completion | None:
        i, finish = message.index, openai_io.FINISH_REASONS.get(message.finish_reason)
        logprobs = list(message.logprobs) if self.logprobs else []
        if not (message.text or finish or logprobs or (self.chat and i not in self.started)):
            return None
        if self.chat:
            role = None if i in self.started else "assistant"
            self.started.add(i)
            return ChatCompletionChunk(**self.head, choices=[ChatChunkChoice(
                index=i, delta=Delta(role=role, content=message.text), finish_reason=finish,
                logprobs=self.token_text.chat(logprobs) if self.logprobs else None)])
        offset, self.offsets[i] = self.offsets[i], self.offsets[i] + len(message.text)
        return Completion(**self.head, choices=[CompletionChoice(
            index=i, text=message.text, finish_reason=finish,
            logprobs=self.token_text.completion(logprobs, offset) if self.logprobs else None)])

    def usage(self, native: gateway_pb2.Usage) -> ChatCompletionChunk | Completion:
        kind = ChatCompletionChunk if self.chat else Completion
        return kind(**self.head, choices=[], usage=openai_io.usage(native))


async def _unless_gone(request: Request, awaitable):
    """``awaitable``'s result, unless the client disconnects first: then it is cancelled (a
    request in the front end frees what it holds) and :class:`_ClientGone` is raised."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, StatusError):
        await work
    raise _ClientGone


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _deadline(timeout: str | None) -> float | None:
    """The loop time a request's ``X-Request-Timeout`` (seconds) ends at, or ``None``.

    Raises:
        StatusError: ``INVALID_ARGUMENT`` naming ``x-request-timeout``: not a positive number.
    """
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 1e8:
        raise StatusError.invalid_argument("x-request-timeout",
                                           f"must be a positive number of seconds, got {timeout!r}")
    return asyncio.get_running_loop().time() + seconds


def _field(loc: tuple) -> str:
    """A pydantic error location as a field path (``messages[0].role``), without the names of
    union members pydantic adds (``str``, ``list[int]``)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif path and (not part.isidentifier() or part in ("str", "int", "float", "bool")):
            break
        else:
            path += f".{part}" if path else part
    return path or "request"

