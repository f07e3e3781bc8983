"""The one place that maps engine exceptions to gRPC status codes.

``ErrorInterceptor`` wraps every unary and server-streaming handler: an exception escaping the
servicer becomes ``context.abort(code, message)``. Unexpected exceptions become INTERNAL with
their type and message only (the traceback goes to the log, never to the client).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from sluice.engine.errors import ContextLengthError, EngineUnavailableError, QueueFullError, UnsupportedError

log = logging.getLogger("sluice.rpc")

# Order matters: ContextLengthError is also a ValueError.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ContextLengthError, grpc.StatusCode.OUT_OF_RANGE),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (UnsupportedError, grpc.StatusCode.UNIMPLEMENTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error in RPC", exc_info=exc)
    await context.abort(code, message)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort_with(context, exc)

    return handler


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # aclosing: a cancelled call closes the servicer's generator now, which aborts the request.
            async with contextlib.aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort_with(context, exc)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            behavior = handler.unary_stream
            # Async-generator handlers yield; coroutine handlers (health Watch) call context.write.
            wrap = _wrap_stream if inspect.isasyncgenfunction(behavior) else _wrap_unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(behavior), handler.request_deserializer, handler.response_serializer)
        return handler   # streaming-request RPCs (reflection, health Watch) pass through
