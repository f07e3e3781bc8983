"""AFS function calling, for any chat model: the functions go into the system prompt as text, the
call the model starts is grammar-constrained, and it is parsed back from the answer.

Chat templates disagree on tools (SmolLM2's has none), so the facade does not rely on them.
The prompt format, appended to the conversation's system message (or sent as one when there is
none)::

    You can call these functions. Each line is one function as JSON (name, description and a
    JSON schema of its parameters):
    {"name": "get_current_weather", "description": "...", "parameters": {...}}
    To call a function, answer with only one JSON object and nothing else, in this form:
    {"name": "<function name>", "arguments": {"<argument>": <value>, ...}}
    If no function is needed, answer the user directly.

History: an assistant message's ``function_call`` is shown to the model in that same JSON form
(so the model sees its earlier calls as it was asked to write them); a ``role: function``
message becomes an engine tool-result message (role TOOL, ``name`` = the function).

Constraint: the answer is free text until the model writes ``{"name"``; from there it must be a
call of one declared function, ``{"name": "<function>", "arguments": {...}}``, whose arguments
follow that function's ``parameters`` schema, and the answer ends after the call
(``http_facade.tools.call_constraint``; the same triggered tags as OpenAI's tool_choice "auto").

Parsing (``find_call``): the first JSON object in the answer (a ```json fence around it is
fine) whose ``name`` is one of the declared functions, with ``arguments`` (or ``parameters``)
an object or a JSON string of one; ``{"function_call": {...}}`` is unwrapped. A call found →
``function_call`` {name, arguments}, ``finish_reason`` "function_call" and ``generated_text``
the text around the call (usually empty). Anything else is an ordinary answer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.afs_errors import invalid

_INTRO = ("You can call these functions. Each line is one function as JSON (name, description and a JSON "
          "schema of its parameters):")
_HOW = ("To call a function, answer with only one JSON object and nothing else, in this form:\n"
        '{"name": "<function name>", "arguments": {"<argument>": <value>, ...}}\n'
        "If no function is needed, answer the user directly.")


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    schema_json: str     # the function's definition as sent, one JSON line


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: dict
    text: str            # the answer's text outside the call, stripped

    def body(self) -> dict:
        return {"name": self.name, "arguments": self.arguments}


def parse_functions(value: Any) -> tuple[FunctionSpec, ...]:
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise invalid("functions: must be a list of function definitions", "functions")
    specs: list[FunctionSpec] = []
    for i, f in enumerate(value):
        where = f"functions[{i}]"
        if not isinstance(f, dict):
            raise invalid(f"{where}: must be an object", where)
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.name: must be a non-empty string", f"{where}.name")
        if any(s.name == name for s in specs):
            raise invalid(f"{where}.name: function {name!r} is declared twice", f"{where}.name")
        desc, params = f.get("description"), f.get("parameters")
        if desc is not None and not isinstance(desc, str):
            raise invalid(f"{where}.description: must be a string", f"{where}.description")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{where}.parameters: must be a JSON schema object", f"{where}.parameters")
        definition = {"name": name, "description": desc or "", "parameters": params or {}}
        specs.append(FunctionSpec(name, json.dumps(definition, ensure_ascii=False)))
    return tuple(specs)


def function_prompt(functions: tuple[FunctionSpec, ...]) -> str:
    return "\n".join([_INTRO, *(f.schema_json for f in functions), _HOW])


def with_function_prompt(messages: list[pb.ChatMessage], functions: tuple[FunctionSpec, ...]
                         ) -> list[pb.ChatMessage]:
    prompt = function_prompt(functions)
    if messages and messages[0].role == pb.ROLE_SYSTEM:
        first = pb.ChatMessage()
        first.CopyFrom(messages[0])
        first.content = f"{first.content}\n\n{prompt}" if first.content else prompt
        return [first, *messages[1:]]
    return [pb.ChatMessage(role=pb.ROLE_SYSTEM, content=prompt), *messages]


def call_text(call: Any, where: str) -> str:
    """An assistant message's ``function_call`` in the prompt's JSON form."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise invalid(f"{where}: must be an object with a non-empty name", where)
    args = _arguments(call.get("arguments", {}))
    if args is None:
        raise invalid(f"{where}.arguments: must be an object or a JSON string of one", f"{where}.arguments")
    return json.dumps({"name": call["name"], "arguments": args}, ensure_ascii=False)


def _arguments(value: Any) -> dict | None:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, dict) else None


def _as_call(obj: Any, names: set[str]) -> tuple[str, dict] | None:
    if isinstance(obj, dict) and isinstance(obj.get("function_call"), dict):
        obj = obj["function_call"]
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else (obj["name"], args)


def find_call(text: str, functions: tuple[FunctionSpec, ...]) -> FunctionCall | None:
    """The first JSON object in ``text`` that calls a declared function, or None."""
    names = {f.name for f in functions}
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
            continue
        call = _as_call(obj, names)
        if call is not None:
            rest = (_strip_fence_open(text[:start]) + _strip_fence_close(text[end:])).strip()
            return FunctionCall(call[0], call[1], rest)
        start = text.find("{", end)
    return None


def _strip_fence_open(before: str) -> str:
    s = before.rstrip()
    for fence in ("```json", "```"):
        if s.endswith(fence):
            return s[: -len(fence)]
    return before


def _strip_fence_close(after: str) -> str:
    s = after.lstrip()
    return s[3:] if s.startswith("```") else after
