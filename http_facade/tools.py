"""Tool calling in the OpenAI dialect: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

The engine renders the tools through the model's chat template, or through sluice's fallback
prompt (``engine/tool_prompt.py``) when the template has no tools. Every call the model writes
is one JSON object, ``{"name": "get_weather", "arguments": {"city": "Paris"}}`` (the fallback
prompt asks for a JSON list of them), and its arguments always validate against the function's
``parameters``, because the call is grammar-constrained:

  * ``tool_choice: "auto"`` (OpenAI's default when tools are given): the model writes text, or
    calls, or both. The text is free; as soon as it writes ``{"name"`` the rest of the call is
    constrained to one of the tools (a ``TriggeredTagsConstraint``), then the text is free again.
    With ``parallel_tool_calls: false`` the answer ends after the first call;
  * ``tool_choice: "required"``: a JSON list of one call or more (exactly one with
    ``parallel_tool_calls: false``) of any of the tools, constrained from the first token;
  * ``tool_choice: {"type": "function", "function": {"name": "f"}}``: exactly one call of ``f``;
  * ``tool_choice: "none"``: no tools are offered and nothing is constrained.

``CallScanner`` splits the answer into text and calls, the same way for a stream and a whole
response: the calls become ``tool_calls`` (ids ``call_...``), the text around them the message's
``content`` (without the list brackets, commas, ``<tool_call>`` tags or code fences that
surround the calls), and ``finish_reason`` is ``"tool_calls"`` when the model made a call and
stopped. Streams send OpenAI-shaped ``tool_calls`` deltas: index, id and name first, then the
arguments, each call as soon as it is complete; a call cut by ``length`` is sent as text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.client_tools import tool_definitions
from sluice.http_facade.errors import bad_request


TRIGGER = '{"name"'      # where a call begins; what the grammar of "auto" waits for


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[pb.ToolDefinition, ...]       # offered to the template
    constraint: pb.StructuredOutput            # the calls' grammar
    mode: str                                  # "auto" or "forced" (required / a named function)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.function.name for t in self.tools)


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
        return ToolPlan(tuple(tools), call_constraint([_signature(t) for t in tools], "tools", not parallel), "auto")
    offered = [t for t in tools if named is None or t.function.name == named]
    schema = calls_schema(offered, single=named is not None or not parallel)
    constraint = pb.StructuredOutput(param="tools")
    constraint.json_schema.schema_json = json.dumps(schema, ensure_ascii=False)
    constraint.json_schema.strict = True
    return ToolPlan(tuple(tools), constraint, "forced")


def _signature(tool: pb.ToolDefinition) -> tuple[str, dict]:
    f = tool.function
    return f.name, json.loads(f.parameters_json) if f.HasField("parameters_json") else {}


def call_constraint(functions: list[tuple[str, dict]], param: str, stop_after_first: bool) -> pb.StructuredOutput:
    """Free text, in which each ``{"name"`` starts a call of one of ``functions`` ((name,
    parameters schema) pairs) whose arguments follow that schema: tool_choice "auto", AFS functions."""
    constraint = pb.StructuredOutput(param=param)
    tags = constraint.triggered_tags
    tags.triggers.append(TRIGGER)
    for name, params in functions:
        tags.tags.add(begin=f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
                      schema_json=json.dumps(params or {"type": "object", "properties": {}}, ensure_ascii=False),
                      end="}")
    tags.stop_after_first = stop_after_first
    return constraint


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
    """JSON Schema of the list of calls: each item one tool's name and its arguments. A tool's
    local references (``#/$defs/Item``, ``#``) are relative to its ``parameters``; inside this
    schema they are rewritten to point where those parameters now sit."""
    items = []
    for i, t in enumerate(tools):
        params = json.loads(t.function.parameters_json) if t.function.HasField("parameters_json") else {}
        at = "#/items/properties/arguments" if len(tools) == 1 else f"#/items/anyOf/{i}/properties/arguments"
        items.append({"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": _rebase_refs(params, at[1:]) if params else {"type": "object", "properties": {}}},
            "required": ["name", "arguments"]})
    schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if single:
        schema["maxItems"] = 1
    return schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rebase_refs(node: Any, base: str, names: bool = False) -> Any:
    """A copy of the schema ``node`` whose local ``$ref`` values (``#`` and ``#/...``) are
    prefixed by the JSON pointer ``base`` (where ``node`` sits in the enclosing schema).
    ``names``: ``node`` maps property names to schemas (``properties`` and the like)."""
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if names:
            out[k] = _rebase_refs(v, base)
        elif k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = "#" + base + v[1:]
        elif k in ("const", "enum", "default", "examples"):
            out[k] = v                     # values, not schemas: a "$ref" key in them is data
        else:
            out[k] = _rebase_refs(v, base, names=k in _SCHEMA_MAPS)
    return out


# What may stand before a call (a list's bracket, the comma between calls, Hermes' <tool_call>,
# a code fence) and after it; dropped from the content together with the calls.
_LEAD_IN = ("<tool_call>", "```json", "```", "[", ",")
_LEAD_OUT = ("</tool_call>", "```", "]", ",")
_LONGEST = max(map(len, (TRIGGER, *_LEAD_IN)))
_DECODER = json.JSONDecoder()


def _strip_tokens(text: str, tokens: tuple[str, ...], from_end: bool) -> str:
    while True:
        s = text.rstrip() if from_end else text.lstrip()
        hit = next((t for t in tokens if (s.endswith(t) if from_end else s.startswith(t))), None)
        if hit is None:
            return s
        text = s[:-len(hit)] if from_end else s[len(hit):]


def _partial(text: str, tokens: tuple[str, ...]) -> bool:
    """``text`` (non-empty) is a proper prefix of one of ``tokens``."""
    return any(t.startswith(text) and t != text for t in tokens)


class CallScanner:
    """One choice's answer, fed as it streams, split into content and tool calls.

    ``feed`` and ``finish`` return OpenAI chat deltas (``{"content": ...}``, ``{"tool_calls":
    [...]}``). Text that might still turn out to begin a call (a partial ``{"name"``, a bracket,
    whitespace) is held back until the next text decides it, so no content is ever retracted.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)
        self.buffer = ""
        self.calls: list[dict] = []
        self.content: list[str] = []
        self._after_call = False

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> list[dict]:
        """Everything still held back, as content (a call cut short is text)."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._after_call:
                rest = _strip_tokens(self.buffer, _LEAD_OUT, from_end=False)
                if not final and (not rest or _partial(rest, _LEAD_OUT)):
                    return out     # the call's closing punctuation may still be arriving
                self.buffer, self._after_call = rest, False
            start = self.buffer.find(TRIGGER)
            call = self._call_at(start) if start != -1 else None
            if call is not None and call[0] is None:    # complete JSON, but no call: text
                self._emit(self.buffer[:call[1]], out)
                self.buffer = self.buffer[call[1]:]
                continue
            if call is None:
                if start != -1 and not final:
                    self._text(start, out, keep_tail=True)
                    return out     # a call has begun and is not complete yet
                self._text(len(self.buffer), out, keep_tail=not final)
                return out
            obj, end = call
            before = _strip_tokens(self.buffer[:start], _LEAD_IN, from_end=True)
            self._emit(before, out)
            self._add_call(obj, out)
            self.buffer, self._after_call = self.buffer[end:], True

    def _call_at(self, start: int) -> tuple[dict | None, int] | None:
        """(the call, its end) when a complete call starts at ``start``; (None, end) for complete
        JSON that calls none of the tools; None while it is incomplete (or not JSON at all)."""
        try:
            obj, end = _DECODER.raw_decode(self.buffer, start)
        except json.JSONDecodeError:
            return None
        if isinstance(obj, dict) and obj.get("name") in self.names and isinstance(obj.get("arguments"), dict):
            return obj, end
        return None, end

    def _text(self, end: int, out: list[dict], keep_tail: bool) -> None:
        """Emit ``buffer[:end]`` but, with ``keep_tail``, not the end of it that could still lead
        into a call; what is not emitted stays in the buffer."""
        text = self.buffer[:end]
        cut = len(text)
        if keep_tail:
            for n in range(min(_LONGEST, cut), 0, -1):   # a partial trigger or lead-in token
                tail = text[cut - n:]
                if TRIGGER.startswith(tail) or _partial(tail, _LEAD_IN):
                    cut -= n
                    break
            cut = len(_strip_tokens(text[:cut], _LEAD_IN, from_end=True))
        self._emit(text[:cut], out)
        self.buffer = self.buffer[cut:]

    def _emit(self, text: str, out: list[dict]) -> None:
        if text:
            self.content.append(text)
            out.append({"content": text})

    def _add_call(self, obj: dict, out: list[dict]) -> None:
        i = len(self.calls)
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"], ensure_ascii=False)}}
        self.calls.append(call)
        out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                    "function": {"name": obj["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})


def split_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict]]:
    """A whole answer as (content or None, tool_calls): the stream's split, at once."""
    scanner = CallScanner(names)
    scanner.feed(text)
    scanner.finish()
    content = "".join(scanner.content)
    return (content if content.strip() else None), scanner.calls
