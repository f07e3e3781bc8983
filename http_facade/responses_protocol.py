"""OpenAI's Responses API (``/v1/responses``) → the chat path, and the response objects back.

A request becomes a chat-completions body that ``protocol.parse_chat`` validates and turns into
engine requests, so that tools and structured output take the same grammar path as chat
(``http_facade/tools.py``, ``structured.py``):

  * ``instructions`` → a leading system message (not carried over by ``previous_response_id``,
    as OpenAI documents);
  * ``input``: a string (one user message) or a list of items: messages (``role`` system,
    developer, user or assistant; ``content`` a string or ``input_text`` / ``output_text``
    parts), ``function_call`` items (an assistant's calls; consecutive ones form one assistant
    turn) and ``function_call_output`` items (a tool message answering ``call_id``);
  * ``previous_response_id``: the stored conversation of that response (its input and output)
    goes before ``input``;
  * ``tools``: function tools (``{"type": "function", "name", "description", "parameters",
    "strict"}``), ``tool_choice`` (auto, none, required, or ``{"type": "function", "name"}``),
    ``parallel_tool_calls``;
  * ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
    ``strict``);
  * ``max_output_tokens``, ``temperature``, ``top_p``, ``user``, ``metadata`` (echoed),
    ``store`` (default true);
  * ``include``: only ``message.output_text.logprobs`` (with ``top_logprobs``), the engine's
    logprobs on the output text parts and delta events (not with tools: a tool plan's text is
    split into calls after sampling, which would leave logprobs without their text);
  * ``reasoning``: the served models have no reasoning mode, so ``effort`` / ``summary`` must be
    null or absent (a 400 naming ``reasoning.effort`` otherwise, as OpenAI answers for models
    without one);
  * ``background``: the route answers at once and runs the generation in a task
    (``routes_responses``); it needs ``store`` and cannot be streamed here.
Errors name the Responses parameter (``input[2].call_id``, ``text.format``,
``max_output_tokens``, ``tools[0].name``), also when they come from the chat path's checks.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError, bad_request
from sluice.http_facade.limits import RequestLimits

_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields whose non-empty values ask for what this server does not do.
_UNSUPPORTED = ("prompt", "conversation")
INCLUDE_LOGPROBS = "message.output_text.logprobs"
_REASONING_FIELDS = ("effort", "summary", "generate_summary")
_TOP_LOGPROBS_MAX = 20
_METADATA_KEYS = 16
# The chat path's parameter names → the Responses names, for errors (first matching prefix wins).
_RENAMES = (("max_tokens", "max_output_tokens"), ("response_format", "text.format"), ("messages", "input"),
            ("prompt", "input"))


@dataclass(frozen=True)
class ResponsesRequest:
    chat_body: dict                  # a chat-completions body for protocol.parse_chat
    conversation: list[dict]         # the chat messages of this turn, previous ones included
    echo: dict                       # the request fields the response object repeats
    stream: bool
    store: bool
    logprobs: bool = False           # include: message.output_text.logprobs
    background: bool = False


def _check_unsupported(body: dict) -> None:
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise bad_request(f"{name}: not supported by this server", name)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise bad_request(f"truncation: only \"disabled\" is supported, got {truncation!r}", "truncation")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("reasoning: must be an object", "reasoning")
    for name in _REASONING_FIELDS:
        if (reasoning or {}).get(name) is not None:
            raise bad_request(f"reasoning.{name}: not supported with this model (it has no reasoning mode)",
                              f"reasoning.{name}", "unsupported_parameter")


def _include_logprobs(body: dict) -> bool:
    """Whether ``include`` asks for the output text's logprobs (the one value offered)."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad_request("include: must be a list of strings", "include")
    other = next((v for v in include if v != INCLUDE_LOGPROBS), None)
    if other is not None:
        raise bad_request(f"include: {other!r} is not supported; this server can include only "
                          f"{INCLUDE_LOGPROBS}", "include")
    if include and body.get("tools"):
        raise bad_request(f"include: {INCLUDE_LOGPROBS} cannot be combined with tools", "include")
    return bool(include)


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts (input_text, output_text) are supported, got "
                              f"{kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, where: str) -> str:
    v = item.get(name)
    if not isinstance(v, str) or not v:
        raise bad_request(f"{where}.{name}: must be a non-empty string", f"{where}.{name}")
    return v


def input_messages(value: Any) -> list[dict]:
    """``input`` as chat messages (OpenAI chat shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input: must be a string or a non-empty list of input items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role: must be one of {', '.join(_ROLES)}; got {role!r}", f"{where}.role")
            out.append({"role": role, "content": _parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _arguments(item, where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise bad_request(f"{where}.type: must be message, function_call or function_call_output; got "
                              f"{kind!r}", f"{where}.type")
    return out


def _arguments(item: dict, where: str) -> str:
    args = item.get("arguments")
    if not isinstance(args, str):
        raise bad_request(f"{where}.arguments: must be a string of JSON", f"{where}.arguments")
    return args


def _tools(value: Any) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools: must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(f"{where}.type: only function tools are supported, got {kind!r}", f"{where}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        if not isinstance(value.get("name"), str):
            raise bad_request("tool_choice.name: must name one of the tools", "tool_choice.name")
        return {"type": "function", "function": {"name": value["name"]}}
    if value is not None and not isinstance(value, str):
        raise bad_request("tool_choice: must be auto, none, required or {\"type\": \"function\", \"name\": ...}",
                          "tool_choice")
    return value


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text: must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type: must be text, json_object or json_schema", "text.format.type")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if "schema" not in fmt:
        raise bad_request("text.format.schema: required for json_schema", "text.format.schema")
    inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": inner}


def _metadata(value: Any) -> dict:
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > _METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
        raise bad_request(f"metadata: at most {_METADATA_KEYS} string keys with string values", "metadata")
    return value


def parse_request(body: dict, previous: list[dict] | None) -> ResponsesRequest:
    """``previous``: the stored conversation of ``previous_response_id`` (the route looks it up)."""
    _check_unsupported(body)
    model = protocol.get_model(body)
    instructions = protocol.get_str(body, "instructions")
    if body.get("input") is None:
        raise bad_request("input: required (a string or a list of input items)", "input")
    turn = input_messages(body["input"])
    conversation = list(previous or []) + turn
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    max_out = protocol.get_int(body, "max_output_tokens")
    if max_out is not None and max_out < 1:
        raise bad_request(f"max_output_tokens: must be >= 1, got {max_out}", "max_output_tokens")
    chat = {"model": model, "messages": messages, "stream": protocol.get_bool(body, "stream"),
            "max_tokens": max_out, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _format(body.get("text")),
            "user": body.get("user")}
    logprobs = _include_logprobs(body)
    if logprobs:
        chat.update(logprobs=True, top_logprobs=protocol.get_int(body, "top_logprobs", (0, _TOP_LOGPROBS_MAX)) or 0)
    chat = {k: v for k, v in chat.items() if v is not None}
    store, background = protocol.get_bool(body, "store", True), protocol.get_bool(body, "background")
    if background and not store:
        raise bad_request("background: a background response is stored; it cannot have store false", "background")
    if background and chat["stream"]:
        raise bad_request("stream: a background response cannot be streamed by this server; poll "
                          "GET /v1/responses/{id} instead", "stream")
    echo = {"model": model, "instructions": instructions, "max_output_tokens": max_out,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "metadata": _metadata(body.get("metadata")), "user": body.get("user"), "truncation": "disabled",
            "background": background}
    return ResponsesRequest(chat, conversation, echo, chat["stream"], store, logprobs, background)


def parse_chat(req: ResponsesRequest, default_max_tokens: int | None, limits: RequestLimits) -> protocol.GenerationPlan:
    """``protocol.parse_chat`` on the translated body, its errors renamed to the Responses names."""
    try:
        return protocol.parse_chat(req.chat_body, default_max_tokens, limits)
    except ApiError as err:
        raise renamed(err) from None


def renamed(err: ApiError) -> ApiError:
    for old, new in _RENAMES:
        if err.param is not None and err.param.startswith(old):
            err.param = new + err.param[len(old):]
        if err.message.startswith(old):
            err.message = new + err.message[len(old):]
    if err.param is not None and err.param.startswith("tools[") and ".function." in err.param:
        err.param = err.param.replace(".function.", ".", 1)
        err.message = err.message.replace(".function.", ".", 1)
    return err


# ------------------------------------------------------------------------------ output items
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)] if status == "completed" else []}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """``logprobs``: ``shapes.chat_logprobs``' content items (empty unless ``include`` asked)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """``call``: a chat tool call (``tools.CallScanner``'s)."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(resp_id: str, created: int, echo: dict, status: str, output: list[dict],
                    usage_body: dict | None, store: bool, incomplete: str | None = None,
                    error: dict | None = None) -> dict:
    return {"id": resp_id, "object": "response", "created_at": created, "status": status, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None, **echo,
            "output": output, "usage": usage_body, "store": store, "reasoning": {"effort": None, "summary": None}}


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as chat messages (what ``previous_response_id`` carries on)."""
    out: list[dict] = []
    for item in output:
        if item["type"] == "message":
            out.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return out


def now() -> int:
    return int(time.time())


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
