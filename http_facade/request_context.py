"""Per-request operations: the request id, the structured request log and the tracing span.

* ``X-Request-Id``: a client's id (1-128 characters of ``A-Z a-z 0-9 . _ : -``) is the base of
  the engine request ids (``<id>-<prompt index>``) and comes back in the response header; without
  one the facade makes one up (``req-<hex>``) and returns it the same way. A malformed id is a 400
  naming ``X-Request-Id``. An id that is still in flight cannot be used again until it ends (the
  engine refuses a duplicate).
* ``--request-log json``: one JSON line per request on stderr (logger ``sluice.facade.requests``):
  time, request id, method, path, status, model, outcome and timings (``duration_s``; for
  generation also ``ttft_s``, ``prompt_tokens``, ``completion_tokens``, ``tokens_per_s``).
* ``--otlp-traces-endpoint``: a SERVER span per request (``POST /v1/chat/completions``), current
  while the handler runs, so that the engine calls it makes carry its ``traceparent``
  (``engine_link``; the engine's span is its child).

The middleware is the outermost one, so that every answer (preflights, auth and limit errors
included) gets its id, its log line and its span.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sys
import time
import uuid

from aiohttp import web

from sluice.http_facade.afs_errors import afs_error_body, is_afs_path
from sluice.http_facade.errors import bad_request
from sluice.http_facade.generation import RequestTimer
from sluice.http_facade.state import state_of

REQUEST_ID: web.RequestKey[str] = web.RequestKey("sluice_request_id", str)
# Generation routes put their timer here, for the log line.
TIMER: web.RequestKey[RequestTimer] = web.RequestKey("sluice_request_timer", RequestTimer)
HEADER = "X-Request-Id"
_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

request_log = logging.getLogger("sluice.facade.requests")


def request_id_of(request: web.Request) -> str:
    """The request's id (the client's ``X-Request-Id`` or one made up)."""
    return request.get(REQUEST_ID) or f"req-{uuid.uuid4().hex}"


def route_name(request: web.Request) -> str:
    """The matched route's pattern (``/v1/models/{model}``), for metrics and logs."""
    info = request.match_info.route
    resource = info.resource if info is not None else None
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def request_context_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = state_of(request)
    given = request.headers.get(HEADER)
    if given is not None and not _ID_RE.match(given):
        err = bad_request(f"{HEADER}: 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'", HEADER)
        body = afs_error_body(err) if is_afs_path(request.path) else err.body()
        return web.json_response(body, status=400)
    request[REQUEST_ID] = given or f"req-{uuid.uuid4().hex}"
    start = time.monotonic()
    status, outcome = 500, "error"
    span_cm = (state.tracing.server_span(f"{request.method} {route_name(request)}",
                                         attributes={"http.request.method": request.method,
                                                     "url.path": request.path,
                                                     "sluice.request_id": request[REQUEST_ID]})
               if state.tracing is not None else contextlib.nullcontext())
    with span_cm as span:
        try:
            response = await handler(request)
            status, outcome = response.status, "ok" if response.status < 400 else "error"
            return response
        except (asyncio.CancelledError, ConnectionError):
            outcome = "cancelled"      # the client left
            raise
        finally:
            if span is not None:
                span.set_attribute("http.response.status_code", status)
            if state.config.request_log == "json":
                _log(request, status, outcome, time.monotonic() - start)


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every response, streams included, names its request id."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[HEADER] = rid


def _log(request: web.Request, status: int, outcome: str, duration: float) -> None:
    line: dict = {"ts": round(time.time(), 3), "request_id": request.get(REQUEST_ID), "method": request.method,
                  "path": request.path, "route": route_name(request), "status": status, "outcome": outcome,
                  "duration_s": round(duration, 6)}
    timer = request.get(TIMER)
    if timer is not None:
        line["model"] = timer.model or None
        line["ttft_s"] = None if timer.ttft is None else round(timer.ttft, 6)
        line["prompt_tokens"], line["completion_tokens"] = timer.prompt_tokens, timer.completion_tokens
        decode = timer.last_token - timer.first_token if timer.first_token and timer.last_token else 0.0
        line["tokens_per_s"] = round((timer.completion_tokens - 1) / decode, 3) if decode > 0 else None
    request_log.info(json.dumps(line, ensure_ascii=False, separators=(",", ":")))


def configure_request_log() -> None:
    """The request log's lines are bare JSON on stderr, whatever the root logger's format."""
    if not request_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
