"""Tool calling in the OpenAI dialect: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

The engine renders the tools through the model's chat template, or through sluice's fallback
prompt (``engine/tool_prompt.py``) when the template has no tools. A forced call is constrained
by a JSON Schema over the fallback's list of calls, so its arguments always validate against the
function's ``parameters``::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

  * ``tool_choice: "required"``: one call or more (exactly one with ``parallel_tool_calls:
    false``) of any of the tools;
  * ``tool_choice: {"type": "function", "function": {"name": "f"}}``: exactly one call of ``f``;
  * ``tool_choice: "none"``: no tools are offered and nothing is constrained;
  * ``tool_choice: "auto"`` (OpenAI's default when tools are given) is refused with a 400 until
    sluice can let the model choose between text and a constrained call.
The response carries ``tool_calls`` (ids ``call_...``) and ``finish_reason: "tool_calls"``;
streams send OpenAI-shaped ``tool_calls`` deltas: index, id and name first, then the arguments.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.client_tools import tool_definitions
from sluice.http_facade.errors import bad_request


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[pb.ToolDefinition, ...]       # offered to the template
    constraint: pb.StructuredOutput | None     # the forced call's grammar; None: none forced


def tool_plan(body: dict) -> ToolPlan | None:
    """None when no tools take part (none given, or tool_choice "none")."""
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, [], {}):
            raise bad_request(f"{name}: the deprecated functions API is not supported; use tools and "
                              "tool_choice", name)
    raw = body.get("tools")
    choice = body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request("tools: must be a list of tools", "tools")
    try:
        tools = tool_definitions(raw)
    except ValueError as exc:   # "tools[0].function.name: ..."
        raise bad_request(str(exc), str(exc).split(":", 1)[0]) from None
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls: must be a boolean", "parallel_tool_calls")
    named = _named(choice, tools)
    if choice in (None, "auto"):
        raise bad_request('tool_choice: "auto" (the default when tools are given) is not supported yet; '
                          'set tool_choice to "required" or {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    offered = [t for t in tools if named is None or t.function.name == named]
    schema = calls_schema(offered, single=named is not None or not parallel)
    constraint = pb.StructuredOutput(param="tools")
    constraint.json_schema.schema_json = json.dumps(schema, ensure_ascii=False)
    constraint.json_schema.strict = True
    return ToolPlan(tuple(tools), constraint)


def _named(choice: Any, tools: list[pb.ToolDefinition]) -> str | None:
    if choice in (None, "auto", "none", "required"):
        return None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(choice.get("function"), dict):
        raise bad_request('tool_choice: must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', "tool_choice")
    name = choice["function"].get("name")
    if name not in {t.function.name for t in tools}:
        raise bad_request(f"tool_choice: function {name!r} is not among the tools", "tool_choice")
    return name


def calls_schema(tools: list[pb.ToolDefinition], single: bool) -> dict:
    """JSON Schema of the list of calls: each item one tool's name and its arguments."""
    items = []
    for t in tools:
        params = json.loads(t.function.parameters_json) if t.function.HasField("parameters_json") else {}
        items.append({"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": params or {"type": "object", "properties": {}}},
            "required": ["name", "arguments"]})
    schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


def parse_calls(text: str) -> list[dict]:
    """The constrained output as OpenAI ``tool_calls``, each with a fresh id."""
    calls = json.loads(text)
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def call_deltas(calls: list[dict]) -> list[dict]:
    """Stream deltas: for each call its index, id, type and name, then its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out
