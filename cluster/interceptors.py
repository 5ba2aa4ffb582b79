"""Server interceptors of every Tandem server, and the one way they wrap a method's handler.

:func:`wrap_handler` runs a method's behaviour inside a scope (an async context manager entered
in the call's own task, so context variables set there reach the servicer) and can check every
request message first. :class:`MalformedRequestInterceptor` uses it so that bytes that do not
parse as the method's request message get ``INVALID_ARGUMENT`` with a generic message, instead
of grpcio's ``UNKNOWN`` naming the Python exception.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Scope = Callable[[grpc.aio.ServicerContext], contextlib.AbstractAsyncContextManager]
Check = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]

MALFORMED_MESSAGE = "request: not a valid protobuf message of this method's request type"


@contextlib.asynccontextmanager
async def _no_scope(context: grpc.aio.ServicerContext):
    yield


def wrap_handler(handler: grpc.RpcMethodHandler, *, scope: Scope = _no_scope,
                 check: Check | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour run inside ``scope(context)``, each request message given
    to ``check(message, context)`` first (which may ``context.abort``).

    Works for the four kinds of method, with a behaviour that is a coroutine function or (for a
    response stream) an async generator function.
    """
    kind = f"{'stream' if handler.request_streaming else 'unary'}_{'stream' if handler.response_streaming else 'unary'}"
    behavior = getattr(handler, kind)

    async def checked(requests: AsyncIterator[Any], context) -> AsyncIterator[Any]:
        async for message in requests:
            await check(message, context)
            yield message

    async def prepare(request, context):
        if check is None:
            return request
        if handler.request_streaming:
            return checked(request, context)
        await check(request, context)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            async with scope(context):
                request = await prepare(request, context)
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
    else:
        async def wrapped(request, context):
            async with scope(context):
                request = await prepare(request, context)
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

    return handler._replace(**{kind: wrapped})


class _Malformed:
    """Stands for a request message that did not parse (the behaviour never sees it)."""


_MALFORMED = _Malformed()


async def _refuse_malformed(message: Any, context: grpc.aio.ServicerContext) -> None:
    if message is _MALFORMED:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED_MESSAGE)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse gets ``INVALID_ARGUMENT`` (:data:`MALFORMED_MESSAGE`),
    on unary and streaming methods alike."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return deserialize(data)
            except DecodeError:
                return _MALFORMED

        return wrap_handler(handler._replace(request_deserializer=tolerant), check=_refuse_malformed)
