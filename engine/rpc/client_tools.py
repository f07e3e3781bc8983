"""Client-side builders of the typed tool messages (``ToolDefinition``, ``ToolCall``) from the
OpenAI-shaped dicts that callers already hold (used by ``sluice.engine.client``; no torch, no
engine internals):

    {"type": "function", "function": {"name": "get_weather", "description": "...",
                                      "parameters": {"type": "object", "properties": {...}}}}
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{...}"}}

``type`` may be left out (function is the only type). ``parameters`` is a JSON Schema object (a
mapping, sent as JSON text; a string is taken as that JSON text already); ``arguments`` is JSON
text as the model wrote it (a mapping is serialised). Bad input raises ``ValueError`` naming the
field (``tools[0].function.name: ...``).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb


def _mapping(value: Any, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be an object (a dict), got {type(value).__name__}")
    return value


def _tool_type(item: Mapping, where: str) -> int:
    kind = item.get("type", "function")
    if kind != "function":
        raise ValueError(f"{where}.type: must be 'function', got {kind!r}")
    return pb.TOOL_TYPE_FUNCTION


def _name(function: Mapping, where: str) -> str:
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name: must be a non-empty string, got {name!r}")
    return name


def _json_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value, ensure_ascii=False)
    raise ValueError(f"{where}: must be an object (a dict) or its JSON text, got {type(value).__name__}")


def tool_definition(tool: Any, where: str) -> pb.ToolDefinition:
    tool = _mapping(tool, where)
    msg = pb.ToolDefinition(type=_tool_type(tool, where))
    function = _mapping(tool.get("function"), f"{where}.function")
    msg.function.name = _name(function, where)
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise ValueError(f"{where}.function.description: must be a string")
        msg.function.description = description
    if function.get("parameters") is not None:
        msg.function.parameters_json = _json_text(function["parameters"], f"{where}.function.parameters")
    return msg


def tool_call(call: Any, where: str) -> pb.ToolCall:
    call = _mapping(call, where)
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise ValueError(f"{where}.id: must be a string")
    msg = pb.ToolCall(id=call_id, type=_tool_type(call, where))
    function = _mapping(call.get("function"), f"{where}.function")
    msg.function.name = _name(function, where)
    arguments = function.get("arguments")
    if arguments is not None:
        msg.function.arguments = _json_text(arguments, f"{where}.function.arguments")
    return msg


def tool_definitions(tools: Sequence[Any]) -> list[pb.ToolDefinition]:
    return [tool_definition(t, f"tools[{i}]") for i, t in enumerate(tools)]


def tool_calls(calls: Any, where: str) -> list[pb.ToolCall]:
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}: must be a list of tool calls, got {type(calls).__name__}")
    return [tool_call(c, f"{where}[{j}]") for j, c in enumerate(calls)]
