"""Reranking and scoring in the shapes RAG tools send: ``POST /v1/rerank`` and ``/rerank`` (the
Jina / Cohere request that vLLM and llama.cpp also serve) and ``POST /v1/score`` (vLLM's).

Both go to the engine's Rerank RPC the way AFS's ``/models/rerank`` does (``resolve_encoder``:
the model is the served model or its embedding / rerank model's name; ``call_encoder``: an
engine without an encoder is a 400 ``model_not_supported``).

Rerank: ``query`` and ``documents`` (strings, or ``{"text": ...}`` objects as Cohere allows),
``top_n`` (default: all), ``return_documents`` (default true). Answer: ``{"id", "model",
"results": [{"index", "relevance_score", "document": {"text"}}] best first, "usage":
{"prompt_tokens", "total_tokens"}}``.

Score: ``text_1`` and ``text_2``, each a string or a list of strings: one text against each of
the others (1 : N), or two lists of one length scored pairwise (N : N). Answer: ``{"id",
"object": "list", "created", "model", "data": [{"index", "object": "score", "score"}] in input
order, "usage"}``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models, protocol
from sluice.http_facade.errors import bad_request
from sluice.http_facade.json_body import read_json
from sluice.http_facade.routes_embeddings import call_encoder, resolve_encoder
from sluice.http_facade.state import state_of


def _text(value: Any, where: str) -> str:
    if isinstance(value, dict):
        value = value.get("text")
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}: must be a non-empty string or an object with a non-empty \"text\"", where)
    return value


def rerank_request(body: dict) -> tuple[pb.RerankRequest, bool]:
    """The engine request, and whether the documents go back in the answer."""
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("query: must be a non-empty string", "query")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise bad_request("documents: must be a non-empty list of strings or {\"text\": ...} objects", "documents")
    texts = [_text(d, f"documents[{i}]") for i, d in enumerate(docs)]
    req = pb.RerankRequest(query=query, documents=texts)
    top_n = protocol.get_int(body, "top_n")
    if top_n is not None:
        if top_n < 1:
            raise bad_request(f"top_n: must be >= 1, got {top_n}", "top_n")
        req.top_n = min(top_n, len(texts))
    return req, protocol.get_bool(body, "return_documents", True)


async def rerank(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.config.body_timeout_s)
    api_models.check(api_models.RerankRequest, body)
    model = await resolve_encoder(state, protocol.get_model(body), "rerank")
    req, with_docs = rerank_request(body)
    resp = await call_encoder(state.link.rerank, req, model, "rerank")
    results = []
    for r in resp.results:
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.score}
        if with_docs:
            item["document"] = {"text": req.documents[r.index]}
        results.append(item)
    tokens = resp.usage.prompt_tokens
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": body["model"], "results": results,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _texts(value: Any, name: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name}: must be a non-empty string or a non-empty list of strings", name)
    return [_text(v, f"{name}[{i}]") for i, v in enumerate(value)]


def score_request(body: dict) -> pb.RerankRequest:
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(f"text_2: must hold as many texts as text_1 ({len(first)}) when text_1 is a list, "
                          f"got {len(second)}", "text_2")
    return pb.RerankRequest(pairs=[pb.RerankPair(query=q, document=d) for q, d in zip(first, second)])


async def score(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.config.body_timeout_s)
    api_models.check(api_models.ScoreRequest, body)
    model = await resolve_encoder(state, protocol.get_model(body), "rerank")
    req = score_request(body)
    resp = await call_encoder(state.link.rerank, req, model, "rerank")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(resp.scores)]
    tokens = resp.usage.prompt_tokens
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": body["model"], "data": data,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})
