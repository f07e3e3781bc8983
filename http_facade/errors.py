"""Errors in the OpenAI shape, and the one mapping from gRPC status codes to HTTP statuses.

Every error the facade returns is ``{"error": {"message", "type", "param", "code"}}``. Handlers
raise ``ApiError``; the error middleware (``app.py``) renders it. An engine error arrives as a
``grpc.aio.AioRpcError`` and becomes an ``ApiError`` through ``from_rpc_error``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # imported where used: ApiError reaches the supervisor (auth.py), which runs no gRPC
    import grpc

# Seconds a client should wait before retrying a request refused for a full queue.
RETRY_AFTER_S = 1


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "engine_unavailable")


def internal(message: str = "internal server error") -> ApiError:
    return ApiError(500, message, "server_error", None, "internal_error")


_INPUT_ERROR = "ValueError: "


def engine_failure(error: str) -> ApiError:
    """A choice the engine ended with an error: a ValueError is the request's own input proving
    impossible while it ran (a grammar this tokenizer cannot spell), a 400 as the gRPC status
    says (INVALID_ARGUMENT); anything else a 500."""
    if error.startswith(_INPUT_ERROR):
        return bad_request(error[len(_INPUT_ERROR):])
    return internal(f"the engine failed this request: {error or 'unknown error'}")


# An engine field path (``sampling.top_p``, ``chat.messages[1].role``, ``token_ids``) → the
# OpenAI parameter a client sent. Order matters: the first matching prefix wins.
_FIELD_RENAMES: tuple[tuple[str, str], ...] = (
    ("sampling.max_tokens_unlimited", "max_tokens"),
    ("sampling.logprobs", "logprobs"),
    ("sampling.", ""),
    ("chat.messages", "messages"),
    ("chat.", ""),
    ("token_ids", "prompt"),
    ("text", "prompt"),
    ("input", "prompt"),
    ("request_id", "X-Request-Id"),     # the facade's engine ids are the client's X-Request-Id
)
_FIELD_RE = re.compile(r"^([A-Za-z_][\w.\[\]]*):\s")


def param_from_details(details: str) -> str | None:
    """The OpenAI parameter named at the start of an engine error message, if any."""
    m = _FIELD_RE.match(details or "")
    if m is None:
        return None
    path = m.group(1)
    for prefix, repl in _FIELD_RENAMES:
        if path.startswith(prefix):
            return repl + path[len(prefix):]
    return path


def from_rpc_error(err: grpc.aio.AioRpcError) -> ApiError:
    import grpc   # loaded already wherever an RPC error can arrive

    code = err.code()
    details = err.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return bad_request(details, param_from_details(details))
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return bad_request(details, param_from_details(details) or "messages", "context_length_exceeded")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"the engine's queue is full, retry later ({details})", "rate_limit_error",
                        None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return bad_request(details, None, "unsupported")
    if code == grpc.StatusCode.NOT_FOUND:
        return not_found(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return unavailable(f"the engine is unavailable: {details}")
    return internal(f"engine error: {details}")
