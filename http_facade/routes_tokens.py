"""``POST /tokenize`` and ``POST /detokenize``, in the shapes vLLM's and llama.cpp's servers use.

Tokenize takes exactly one of:
  * ``prompt`` (vLLM): a text; ``add_special_tokens`` defaults to true (BOS and the like);
  * ``content`` (llama.cpp): a text; ``add_special`` defaults to false, as llama.cpp's does;
  * ``messages`` (vLLM's chat form): rendered with the model's chat template in the engine
    (``add_generation_prompt`` default true, ``tools`` in the OpenAI shape); the rendered text is
    tokenized without added special tokens, since the template writes its own.
The answer carries both servers' fields: ``{"tokens": [ids], "count": n, "max_model_len": m}``,
and ``"prompt"`` (the rendered text) for messages. ``model`` is optional (vLLM's rule); when given
it must be served. Token strings come from the engine's tokenizer, in each project's shape:
  * ``return_token_strs: true`` (vLLM) adds ``"token_strs"``, the vocabulary's spelling of each
    token (``"Ġhi"``), beside ``tokens``;
  * ``with_pieces: true`` (llama.cpp) turns ``tokens`` into ``[{"id": id, "piece": ...}]``, the
    piece being the token's text, or the list of its byte values when those bytes are not valid
    UTF-8 on their own (part of a character).

Detokenize takes ``tokens`` (a list of ids) and answers ``{"prompt": text, "content": text}``
(vLLM reads ``prompt``, llama.cpp ``content``); ``skip_special_tokens`` defaults to false, so the
text round-trips what ``/tokenize`` produced.
"""
from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models, protocol
from sluice.http_facade.errors import bad_request, from_rpc_error
from sluice.http_facade.json_body import read_json
from sluice.http_facade.state import FacadeState, state_of
from sluice.http_facade.tools import tool_plan

_INT32_MAX = (1 << 31) - 1
_TEXT_FIELDS = ("prompt", "content", "messages")


async def _model(state: FacadeState, body: dict) -> pb.ModelInfo | None:
    name = body.get("model")
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise bad_request("model: must be a served model's name (see GET /v1/models), or left out", "model")
    return await state.resolve_model(name)


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def tokenize_request(body: dict, state: FacadeState) -> pb.TokenizeRequest:
    given = [name for name in _TEXT_FIELDS if body.get(name) is not None]
    if len(given) != 1:
        detail = f"got {' and '.join(given)}" if given else "got none"
        raise bad_request(f"prompt: give exactly one of prompt, content (a text) or messages ({detail})",
                          given[1] if len(given) > 1 else "prompt")
    name = given[0]
    limits = state.config.limits
    if name == "messages":
        protocol.check_message_caps(body["messages"], limits)
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages: must be a non-empty list of messages", "messages")
        if body.get("tools") is not None:
            protocol.check_json_size("tools", body["tools"], limits)
        chat = pb.ChatInput(messages=protocol.chat_messages(messages),
                            add_generation_prompt=protocol.get_bool(body, "add_generation_prompt", True))
        plan = tool_plan({"tools": body.get("tools")})
        if plan is not None:
            chat.tools.extend(plan.tools)
        req = pb.TokenizeRequest(chat=chat)
        if body.get("add_special_tokens") is not None:
            req.add_special_tokens = protocol.get_bool(body, "add_special_tokens")
    else:
        text = body[name]
        if not isinstance(text, str) or not text:
            raise bad_request(f"{name}: must be a non-empty string", name)
        protocol.check_prompt_caps(text, limits, name)
        flag = "add_special_tokens" if name == "prompt" else "add_special"
        req = pb.TokenizeRequest(text=text, add_special_tokens=protocol.get_bool(body, flag, name == "prompt"))
    req.with_pieces = any(protocol.get_bool(body, f, False) for f in ("return_token_strs", "with_pieces"))
    return req


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.config.body_timeout_s)
    api_models.check(api_models.TokenizeRequest, body)
    model = await _model(state, body)
    req = tokenize_request(body, state)
    try:
        resp = await state.link.tokenize(req, model.name if model else None)
    except grpc.aio.AioRpcError as err:
        raise _renamed(from_rpc_error(err), "input", "prompt") from None
    ids = list(resp.token_ids)
    tokens: list = ids
    if protocol.get_bool(body, "with_pieces", False):
        tokens = [{"id": i, "piece": _piece(p)} for i, p in zip(ids, resp.pieces, strict=True)]
    out: dict[str, Any] = {"tokens": tokens, "count": len(ids), "max_model_len": resp.max_model_len}
    if protocol.get_bool(body, "return_token_strs", False):
        out["token_strs"] = list(resp.spellings)
    if req.WhichOneof("input") == "chat":
        out["prompt"] = resp.prompt
    return web.json_response(out)


def token_ids(value: Any, limit: int, name: str = "tokens") -> list[int]:
    if not isinstance(value, list) or not all(protocol.is_int(t) for t in value):
        raise bad_request(f"{name}: must be a list of token ids (integers)", name)
    if len(value) > limit:
        raise bad_request(f"{name}: at most {limit} token ids, got {len(value)} (the server's max_prompt_tokens)",
                          name)
    bad = next((t for t in value if not 0 <= t <= _INT32_MAX), None)
    if bad is not None:
        raise bad_request(f"{name}: token id {bad} is not a vocabulary index", name)
    return value


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request, state.config.body_timeout_s)
    api_models.check(api_models.DetokenizeRequest, body)
    model = await _model(state, body)
    ids = token_ids(body.get("tokens"), state.config.limits.max_prompt_tokens)
    skip = protocol.get_bool(body, "skip_special_tokens", False)
    try:
        text = await state.link.detokenize(ids, model.name if model else None, skip)
    except grpc.aio.AioRpcError as err:
        raise _renamed(from_rpc_error(err), "token_ids", "tokens") from None
    return web.json_response({"prompt": text, "content": text})


def _renamed(err, engine_name: str, param: str):
    """The engine names its own field (``token_ids: ...``); the client sent ``param``."""
    if err.message.startswith(engine_name + ":"):
        err.message = param + err.message[len(engine_name):]
    if err.param is not None:
        err.param = param
    return err
