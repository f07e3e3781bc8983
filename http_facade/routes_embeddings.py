"""``POST /v1/embeddings`` (OpenAI), and the embedding helpers the AFS routes share.

Inputs: a string, a list of strings, a list of token ids (one input) or a list of token-id
lists; token ids are the embedding model's own and are used as given. ``encoding_format``
float | base64 (the float32 values, little-endian, base64-encoded: what the OpenAI SDK decodes
with ``np.frombuffer(..., dtype="float32")``); ``dimensions`` keeps the first N values (then
normalises, as the engine documents).

Which model: the name a request gives may be the served model's name or path, or the name of
the embedding model the engine serves beside it (``ModelInfo.embedding_model``). A model that
exists but has no embedding side answers **400** ``model_not_supported`` (param ``model``), not
404: the model is there, and the request is wrong for it (the same status OpenAI uses for a
model/endpoint mismatch, and the one a client should not retry). An unknown name is 404
``model_not_found``.
"""
from __future__ import annotations

import base64
import struct
from typing import Any

import grpc
from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models
from sluice.http_facade.errors import ApiError, bad_request, from_rpc_error, not_found
from sluice.http_facade.json_body import read_json
from sluice.http_facade.protocol import get_model
from sluice.http_facade.state import FacadeState, state_of

_INT32_MAX = (1 << 31) - 1
EncoderInputs = tuple[list[str], list[list[int]]]    # (texts, token-id lists): exactly one non-empty


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and 0 <= t <= _INT32_MAX for t in ids):
        raise bad_request(f"{where}: must be a non-empty list of token ids (integers >= 0)", where)
    return ids


def encoder_inputs(value: Any, param: str = "input") -> EncoderInputs:
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(value, str) and value:
        return [value], []
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            bad = next((i for i, v in enumerate(value) if not v), None)
            if bad is not None:
                raise bad_request(f"{param}[{bad}]: must be a non-empty string", f"{param}[{bad}]")
            return list(value), []
        if all(_is_int(v) for v in value):
            return [], [_token_ids(value, param)]
        if all(isinstance(v, list) for v in value):
            return [], [_token_ids(v, f"{param}[{i}]") for i, v in enumerate(value)]
    raise bad_request(f"{param}: must be a non-empty string, a list of strings, a list of token ids or a list "
                      "of token-id lists", param)


def encoding_format(body: dict) -> str:
    fmt = body.get("encoding_format")
    if fmt is None:
        return "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"encoding_format: must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    return fmt


def dimensions(body: dict, allow_zero: bool) -> int:
    """0 = the model's full size (AFS's default; OpenAI's omitted value)."""
    v = body.get("dimensions")
    if v is None:
        return 0
    low = 0 if allow_zero else 1
    if not _is_int(v) or not low <= v <= _INT32_MAX:
        raise bad_request(f"dimensions: must be an integer >= {low}, got {v!r}", "dimensions")
    return v


def encode(values: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def embed_request(inputs: EncoderInputs, **options: Any) -> pb.EmbedRequest:
    texts, ids = inputs
    req = pb.EmbedRequest(texts=texts, token_ids=[pb.TokenIds(ids=t) for t in ids])
    for name, value in options.items():
        if value is not None:
            setattr(req, name, value)
    return req


# -------------------------------------------------------------------------------- model
def serves(model: pb.ModelInfo, name: str) -> bool:
    return name in (model.name, model.path) or name in tuple(filter(None, (model.embedding_model,
                                                                            model.rerank_model)))


async def resolve_encoder(state: FacadeState, name: str, capability: str) -> pb.ModelInfo:
    """The served model ``name`` designates, checked for ``capability`` (embeddings | rerank)."""
    models = await state.link.list_models()
    match = next((m for m in models if serves(m, name)), None)
    if match is None:
        served = ", ".join(filter(None, (n for m in models for n in (m.name, m.embedding_model)))) or "none"
        raise not_found(f"The model '{name}' does not exist (served: {served})", "model", "model_not_found")
    if capability not in match.capabilities:
        raise not_supported(match, capability)
    return match


def not_supported(model: pb.ModelInfo, capability: str, detail: str = "") -> ApiError:
    what = "embeddings" if capability == "embeddings" else "reranking"
    return bad_request(f"model {model.name} does not support {what}"
                       f"{': ' + detail if detail else ' (start the engine with --embedding-model)'}",
                       "model", "model_not_supported")


async def call_encoder(call, request, model: pb.ModelInfo, capability: str):
    """``call(request, model name)`` (an ``EnginePool`` method: the engine serving ``model``); the
    engine's UNIMPLEMENTED becomes the 400 ``model_not_supported``."""
    try:
        return await call(request, model.name)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise not_supported(model, capability, err.details() or "") from None
        raise from_rpc_error(err) from None


# -------------------------------------------------------------------------------- route
async def embeddings(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state_of(request).config.body_timeout_s)
    api_models.check(api_models.EmbeddingRequest, body)
    model = await resolve_encoder(state, get_model(body), "embeddings")
    inputs = encoder_inputs(body.get("input"))
    fmt = encoding_format(body)
    req = embed_request(inputs, dimensions=dimensions(body, allow_zero=False))
    resp = await call_encoder(state.link.embed, req, model, "embeddings")
    data = [{"object": "embedding", "index": i, "embedding": encode(list(e.values), fmt)}
            for i, e in enumerate(resp.embeddings)]
    tokens = resp.usage.prompt_tokens
    return web.json_response({"object": "list", "data": data, "model": resp.model or model.embedding_model or model.name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
