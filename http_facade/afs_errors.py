"""The AFS error body, and the statuses AFS routes answer with.

Every non-200 answer of a ``/models/...`` route is JSON::

    {"status_code": 422, "error": "top_k: must be an integer in [1, 100], got 0",
     "detail": "top_k: must be an integer in [1, 100], got 0", "param": "top_k"}

``status_code`` repeats the HTTP status; ``error`` is what the seed's streaming examples print
(``record["status_code"], record["error"]``); ``detail`` carries the same message for the seed's
LangChain wrappers (they read ``detail`` on a non-200); ``param`` names the offending
parameter, or is null. Statuses:

* 422: the request does not validate (a missing field, a wrong type, a value out of range);
* 400: a well-formed request that cannot be served: ``<FILL_ME>`` missing or repeated, the
  prompt plus ``max_new_tokens`` beyond the model's context, a model without infilling /
  embeddings / rerank support, malformed JSON;
* 401: a missing or wrong ``X-API-KEY``; 404: an unknown model or route; 429: the engine's
  queue is full; 503: the engine is unavailable; 500: a fault (never a stack trace).

An error after a stream has started is one SSE record with the same body (the seed's parser
checks ``"status_code" in record``), and the stream ends.
"""
from __future__ import annotations

from sluice.http_facade.errors import ApiError

UNPROCESSABLE = 422
AFS_PREFIX = "/models/"


def invalid(message: str, param: str | None, status: int = UNPROCESSABLE) -> ApiError:
    return ApiError(status, message, "invalid_request_error", param, "invalid_parameter")


def unsupported(message: str, param: str | None = "model") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "model_not_supported")


def is_afs_path(path: str) -> bool:
    return path.startswith(AFS_PREFIX)


def afs_error_body(err: ApiError) -> dict:
    return {"status_code": err.status, "error": err.message, "detail": err.message, "param": err.param}
