"""AFS / Formosa Foundation Model API routes (``/models/...``), as that API documents them.

* ``POST /models/conversation``: ``messages`` (system / human (= user) / assistant / function)
  and optional ``functions`` (see ``afs_functions``), ``parameters`` (see ``afs_protocol``),
  ``stream``. Answer and stream records: see ``afs_generation``.
* ``POST /models/generate``: ``inputs`` text, the same parameters, answer and stream.
* ``POST /models/text_infilling``: ``inputs`` with exactly one ``<FILL_ME>``; the engine builds
  the fill-in-the-middle prompt from the model's own FIM tokens. A model without them → 400.
* ``POST /models/embeddings``: V1 ``inputs`` (list of strings) or V2 / OpenAI-style ``input``;
  ``parameters.input_type`` query | document (default document; query adds the query prefix:
  ``--afs-query-prefix``, else the embedding model's own), ``parameters.normalize`` (default
  true), ``encoding_format`` float | base64, ``dimensions`` (0 = full).
  Answer: ``{data: [{embedding, index, object}], total_time_taken, usage}``.
* ``POST /models/rerank``: ``inputs`` as [query, document] pairs → ``{scores}`` in input order;
  or ``query`` + ``documents`` + ``parameters.top_n`` (default 3) → ``{results: [{score,
  index}]}`` best first. Both with ``usage`` and ``total_time_taken``.

Keys: ``X-API-KEY`` (or ``Authorization: Bearer``), the same keys; ``X-API-HOST`` is ignored.
Errors: ``afs_errors``. Each request is checked against its model in ``api_models`` first
(``afs_protocol.check``). The model a request names must be served (404 otherwise); for
embeddings and rerank the embedding model's own name is accepted too.
"""
from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import afs_protocol as ap
from sluice.http_facade import api_models as am
from sluice.http_facade.afs_errors import invalid, unsupported
from sluice.http_facade.afs_generation import run_afs
from sluice.http_facade.config import AfsConfig
from sluice.http_facade.errors import ApiError
from sluice.http_facade.json_body import read_json
from sluice.http_facade.request_context import request_id_of
from sluice.http_facade.routes_embeddings import (call_encoder, dimensions, embed_request, encode, encoder_inputs,
                                           encoding_format, resolve_encoder)
from sluice.http_facade.state import state_of


AFS_CONFIG: web.AppKey[AfsConfig] = web.AppKey("sluice_afs_config", AfsConfig)


def _config(request: web.Request) -> AfsConfig:
    return request.app.get(AFS_CONFIG) or AfsConfig()


async def _body(request: web.Request) -> dict:
    body = await read_json(request, state_of(request).config.body_timeout_s)
    ap.check_caps(body, state_of(request).config.limits)
    return body


def _elapsed(start: float) -> str:
    return f"{time.monotonic() - start:.2f} sec"


# ------------------------------------------------------------------------------ generation
async def _generate(request: web.Request, gen: ap.AfsGeneration, capability: str | None = None
                    ) -> web.StreamResponse:
    state = state_of(request)
    model = await state.resolve_model(gen.model)
    if capability is not None and capability not in model.capabilities:
        raise unsupported(f"model {model.name} does not support {capability} (its tokenizer has no "
                          "fill-in-the-middle tokens)")
    return await run_afs(request, state, gen, model, request_id_of(request), _config(request).ping_interval_s)


async def conversation(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ap.parse_conversation(await _body(request)))


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ap.parse_generate(await _body(request)))


async def text_infilling(request: web.Request) -> web.StreamResponse:
    return await _generate(request, ap.parse_infilling(await _body(request)), "infilling")


# ------------------------------------------------------------------------------ embeddings
def _embed_options(body: dict, params: am.AfsEmbedParameters, config: AfsConfig) -> dict[str, Any]:
    kind = params.input_type
    options: dict[str, Any] = {"normalize": params.normalize, "dimensions": dimensions(body, allow_zero=True)}
    if kind == "query" and config.query_prefix is not None:
        options["prefix"] = config.query_prefix
    else:
        options["input_type"] = pb.EMBED_INPUT_TYPE_QUERY if kind == "query" else pb.EMBED_INPUT_TYPE_DOCUMENT
    return options


def _embedding_inputs(body: dict):
    has_v1, has_v2 = body.get("inputs") is not None, body.get("input") is not None
    if has_v1 == has_v2:
        raise invalid("inputs: give either inputs (V1) or input (V2), exactly one", "inputs")
    return encoder_inputs(body["inputs"], "inputs") if has_v1 else encoder_inputs(body["input"], "input")


async def embeddings(request: web.Request) -> web.Response:
    start = time.monotonic()
    state = state_of(request)
    body = await _body(request)
    checked = ap.check(am.AfsEmbeddingsRequest, body)
    model = await resolve_encoder(state, checked.model, "embeddings")
    inputs = _validated(_embedding_inputs, body)
    fmt = _validated(encoding_format, body)
    params = checked.parameters or am.AfsEmbedParameters()
    req = embed_request(inputs, **_validated(_embed_options, body, params, _config(request)))
    resp = await call_encoder(state.link.embed, req, model, "embeddings")
    data = [{"embedding": encode(list(e.values), fmt), "index": i, "object": "embedding"}
            for i, e in enumerate(resp.embeddings)]
    tokens = resp.usage.prompt_tokens
    return web.json_response({"data": data, "total_time_taken": _elapsed(start),
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _validated(fn, *args):
    """``fn(*args)``, its 400s as AFS's 422 (they are request-validation failures)."""
    try:
        return fn(*args)
    except ApiError as err:
        if err.status != 400:
            raise
        raise invalid(err.message, err.param) from None


# ---------------------------------------------------------------------------------- rerank
def _pairs(value: Any) -> list[pb.RerankPair]:
    if not isinstance(value, list) or not value:
        raise invalid("inputs: must be a non-empty list of [query, document] pairs", "inputs")
    pairs = []
    for i, p in enumerate(value):
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) and s for s in p)):
            raise invalid(f"inputs[{i}]: must be a [query, document] pair of non-empty strings", f"inputs[{i}]")
        pairs.append(pb.RerankPair(query=p[0], document=p[1]))
    return pairs


def _rerank_request(body: dict, req: am.AfsRerankRequest) -> pb.RerankRequest:
    """``req``: ``body`` checked by its model (types, non-empty strings, ``top_n``)."""
    if body.get("inputs") is not None:
        if req.query is not None or req.documents is not None:
            raise invalid("inputs: give inputs pairs, or query and documents, not both", "inputs")
        return pb.RerankRequest(pairs=_pairs(body["inputs"]))
    if req.query is None:
        raise invalid("query: required (a non-empty string, or send inputs pairs)", "query")
    if req.documents is None:
        raise invalid("documents: required (a non-empty list of non-empty strings)", "documents")
    top_n = (req.parameters or am.AfsRerankParameters()).top_n
    return pb.RerankRequest(query=req.query, documents=req.documents, top_n=min(top_n, len(req.documents)))


async def rerank(request: web.Request) -> web.Response:
    start = time.monotonic()
    state = state_of(request)
    body = await _body(request)
    checked = ap.check(am.AfsRerankRequest, body)
    model = await resolve_encoder(state, checked.model, "rerank")
    req = _rerank_request(body, checked)
    resp = await call_encoder(state.link.rerank, req, model, "rerank")
    tokens = resp.usage.prompt_tokens
    out: dict[str, Any] = ({"scores": list(resp.scores)} if req.pairs else
                           {"results": [{"score": r.score, "index": r.index} for r in resp.results]})
    out.update(total_time_taken=_elapsed(start), usage={"prompt_tokens": tokens, "total_tokens": tokens})
    return web.json_response(out)
