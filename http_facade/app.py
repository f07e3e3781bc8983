"""The aiohttp application: routes, and the middlewares that make every answer OpenAI-shaped.

Middleware order (outermost first): CORS (preflight answers, headers on every response, errors
included) → errors (``ApiError``, aiohttp's HTTP errors, gRPC errors and real faults → the
OpenAI error shape, or the AFS one under ``/models/``; never a stack trace) → drain (503 for new
work while shutting down) → auth (API keys).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from aiohttp import web

from sluice.http_facade import (routes_afs, routes_embeddings, routes_openai, routes_rerank, routes_responses,
                                routes_tokens)
from sluice.http_facade.afs_errors import afs_error_body, is_afs_path
from sluice.http_facade.engine_link import EngineLink
from sluice.http_facade.engine_pool import EnginePool
from sluice.http_facade.errors import ApiError, from_rpc_error, internal, unavailable
from sluice.engine.rpc.tracing import Tracing
from sluice.http_facade.openapi import ENDPOINTS, docs_page, openapi_document
from sluice.http_facade.request_context import (add_request_id_header, configure_request_log,
                                                request_context_middleware, route_name)
from sluice.http_facade.served_names import ServedNames
from sluice.http_facade.sse import CORS_HEADERS
from sluice.http_facade.state import STATE_KEY, FacadeConfig, FacadeState, state_of

log = logging.getLogger("sluice.facade")

_HTTP_ERRORS = {
    404: ("not_found", "invalid_request_error"),
    405: ("method_not_allowed", "invalid_request_error"),
    413: ("request_too_large", "invalid_request_error"),
}


def _from_http_exception(request: web.Request, exc: web.HTTPException, limit: int) -> ApiError:
    code, kind = _HTTP_ERRORS.get(exc.status, ("http_error", "invalid_request_error"))
    if exc.status == 404:
        message = f"no route for {request.method} {request.path} (see /docs)"
    elif exc.status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    elif exc.status == 413:
        message = f"the request body exceeds the limit of {limit} bytes"
    else:
        message = exc.reason or f"HTTP {exc.status}"
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    return ApiError(exc.status, message, kind, None, code, headers)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    state = state_of(request)
    try:
        response = await handler(request)
    except ApiError as err:
        response = _error_response(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _error_response(request, _from_http_exception(request, exc, state.config.max_body_bytes))
    except grpc.aio.AioRpcError as err:
        response = _error_response(request, from_rpc_error(err))
    except (asyncio.CancelledError, ConnectionError):
        raise   # the client is gone: nothing to answer
    except Exception:  # noqa: BLE001 - a real fault: log it, tell the client only that it happened
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = _error_response(request, internal())
    state.metrics.count(route_name(request), response.status)
    return response


def _error_response(request: web.Request, err: ApiError) -> web.Response:
    body = afs_error_body(err) if is_afs_path(request.path) else err.body()   # each dialect its own shape
    return web.json_response(body, status=err.status, headers=err.headers)


@web.middleware
async def drain_middleware(request: web.Request, handler) -> web.StreamResponse:
    """While shutting down, new work is refused; requests in flight run on for the grace."""
    if state_of(request).draining and request.method == "POST":
        raise ApiError(503, "the server is shutting down", "service_unavailable", None, "shutting_down",
                       {"Connection": "close", "Retry-After": "1"})
    return await handler(request)


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    state_of(request).config.auth.check(request)
    return await handler(request)


@web.middleware
async def cors_middleware(request: web.Request, handler) -> web.StreamResponse:
    policy = state_of(request).config.cors
    if policy.is_preflight(request):
        headers = policy.headers_for(request, preflight=True)
        return web.Response(status=204 if headers else 403, headers=headers)
    extra = policy.headers_for(request, preflight=False)
    if extra:
        request[CORS_HEADERS] = extra   # streaming responses add them before prepare()
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        exc.headers.update(extra)
        raise
    if not response.prepared:
        response.headers.update(extra)
    return response


# ----------------------------------------------------------------------------- plain routes
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 while some engine serves and the facade is not draining (Kubernetes' readiness: send
    traffic here); the body lists each engine. /health is liveness: the facade process answers."""
    state = state_of(request)
    if not state.draining and await state.link.serving():
        engines = [{"engine": e.address, "serving": e.up, "reason": e.reason} for e in state.link.engines]
        return web.json_response({"status": "ready", "engines": engines})
    raise unavailable("the engine is not serving (loading, draining or down)")


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    state.metrics.set_loads(await state.link.loads(), state.link.routing_counts())
    return web.Response(body=state.metrics.render(), headers={"Content-Type": state.metrics.content_type})


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=docs_page(), content_type="text/html")


_STATIC = Path(__file__).parent / "static"
_ASSETS = {"/docs/swagger-ui-bundle.js": ("swagger-ui/swagger-ui-bundle.js", "text/javascript"),
           "/docs/swagger-ui.css": ("swagger-ui/swagger-ui.css", "text/css"),
           "/": ("chat/index.html", "text/html"),
           "/ui/chat.js": ("chat/chat.js", "text/javascript"),
           "/ui/chat.css": ("chat/chat.css", "text/css")}


async def asset(request: web.Request) -> web.Response:
    """A file shipped in the package (``static/``)."""
    name, kind = _ASSETS[request.path]
    # Swagger UI changes only with the package; the chat page's files are checked each load.
    cache = "public, max-age=86400" if name.startswith("swagger-ui/") else "no-cache"
    return web.Response(body=(_STATIC / name).read_bytes(), content_type=kind, headers={"Cache-Control": cache})


async def openapi_json(request: web.Request) -> web.Response:
    """The examples name the first served model; without an engine answering, they are left out."""
    try:
        models = await state_of(request).link.list_models()
    except grpc.aio.AioRpcError:
        models = ()
    return web.json_response(openapi_document(model=models[0].name if models else None))


async def dump_event_trace(request: web.Request) -> web.Response:
    state = state_of(request)
    if not state.config.enable_tracing:
        raise ApiError(400, "event tracing is off: start the server with --enable-tracing", "invalid_request_error",
                       None, "tracing_disabled")
    return web.json_response({"object": "list", "data": list(state.traces)})


_HANDLERS = {
    ("GET", "/v1/models"): routes_openai.list_models,
    ("GET", "/v1/models/{model}"): routes_openai.get_model,
    ("POST", "/v1/chat/completions"): routes_openai.chat_completions,
    ("POST", "/v1/completions"): routes_openai.completions,
    ("POST", "/v1/embeddings"): routes_embeddings.embeddings,
    ("POST", "/v1/responses"): routes_responses.create,
    ("GET", "/v1/responses/{response_id}"): routes_responses.retrieve,
    ("DELETE", "/v1/responses/{response_id}"): routes_responses.delete,
    ("POST", "/v1/responses/{response_id}/cancel"): routes_responses.cancel,
    ("POST", "/v1/rerank"): routes_rerank.rerank,
    ("POST", "/rerank"): routes_rerank.rerank,
    ("POST", "/v1/score"): routes_rerank.score,
    ("POST", "/tokenize"): routes_tokens.tokenize,
    ("POST", "/detokenize"): routes_tokens.detokenize,
    ("POST", "/models/conversation"): routes_afs.conversation,
    ("POST", "/models/generate"): routes_afs.generate,
    ("POST", "/models/text_infilling"): routes_afs.text_infilling,
    ("POST", "/models/embeddings"): routes_afs.embeddings,
    ("POST", "/models/rerank"): routes_afs.rerank,
    ("GET", "/health"): health,
    ("GET", "/ready"): ready,
    ("GET", "/metrics"): metrics,
    ("GET", "/docs"): docs,
    ("GET", "/docs/swagger-ui-bundle.js"): asset,
    ("GET", "/docs/swagger-ui.css"): asset,
    ("GET", "/"): asset,
    ("GET", "/ui/chat.js"): asset,
    ("GET", "/ui/chat.css"): asset,
    ("GET", "/openapi.json"): openapi_json,
    ("POST", "/debug/dump_event_trace"): dump_event_trace,
}


def build_app(config: FacadeConfig, link: EngineLink | EnginePool | None = None,
              afs: routes_afs.AfsConfig | None = None, tracing: Tracing | None = None) -> web.Application:
    """The facade app. ``link`` defaults to a pool of channels to ``config.engines`` (its health
    watch starts with the app, and it is closed on cleanup); ``afs``: the AFS dialect's options
    (ping interval, query prefix); ``tracing``: spans per request (default: to
    ``config.otlp_traces_endpoint`` when it is set)."""
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[request_context_middleware, cors_middleware, error_middleware,
                                       drain_middleware, auth_middleware])
    if not isinstance(link, EnginePool):
        links = [link] if link is not None else [EngineLink(addr) for addr in config.engines]
        link = EnginePool(links, policy=config.routing)
    if config.served_model_names:
        link = ServedNames(link, config.served_model_names)
    if tracing is None and config.otlp_traces_endpoint:
        tracing = Tracing.to_otlp(config.otlp_traces_endpoint, "sluice-facade", "sluice.facade")
    if config.request_log == "json":
        configure_request_log()
    app[STATE_KEY] = FacadeState(config, link, tracing)
    app.on_response_prepare.append(add_request_id_header)
    app[routes_afs.AFS_CONFIG] = afs or routes_afs.AfsConfig()
    app[routes_responses.STORE_KEY] = routes_responses.ResponseStore()
    app[routes_responses.BACKGROUND_KEY] = background = routes_responses.Background()
    for ep in ENDPOINTS:
        app.router.add_route(ep.method, ep.path, _HANDLERS[(ep.method, ep.path)])

    async def start_pool(app: web.Application) -> None:
        await app[STATE_KEY].link.start()

    async def close_link(app: web.Application) -> None:
        await app[STATE_KEY].link.close()
        if app[STATE_KEY].tracing is not None:
            app[STATE_KEY].tracing.shutdown()

    app.on_startup.append(start_pool)
    app.on_cleanup.append(background.close)     # before the link closes: their streams use it
    app.on_cleanup.append(close_link)
    return app
