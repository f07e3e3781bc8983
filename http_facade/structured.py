"""Structured output in the OpenAI / MLC / vLLM dialect → the engine's typed ``StructuredOutput``.

Accepted (at most one per request; each on chat and completions, streaming or not):
  * ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
    JSON object; MLC's ``"schema"`` beside it, a JSON Schema object or its JSON text, constrains
    it to that schema), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
    (OpenAI; no ``schema``: any JSON object);
  * vLLM's extras: ``guided_json`` (a JSON Schema, object or text), ``guided_regex`` (a regular
    expression the whole output matches), ``guided_choice`` (a list of strings: the output is
    exactly one of them), ``guided_grammar`` (an EBNF grammar in xgrammar's GBNF-like dialect,
    with a ``root`` rule).
Bad shapes are a 400 naming the parameter here; whether a schema, regex or grammar compiles is
the engine's to say (its INVALID_ARGUMENT names the same parameter).
"""
from __future__ import annotations

import json
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.errors import bad_request

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_output(body: dict) -> pb.StructuredOutput | None:
    """The constraint the body asks for, or None; a 400 naming the parameter when malformed."""
    asked = [name for name in ("response_format", *GUIDED) if body.get(name) is not None]
    fmt = _response_format(body["response_format"]) if "response_format" in asked else None
    if fmt is None and "response_format" in asked:
        asked.remove("response_format")                 # {"type": "text"}
    if len(asked) > 1:
        raise bad_request(f"{asked[1]}: only one of response_format, {', '.join(GUIDED)} may be set "
                          f"(also got {asked[0]})", asked[1])
    if fmt is not None or not asked:
        return fmt
    name = asked[0]
    value = body[name]
    msg = pb.StructuredOutput(param=name)
    if name == "guided_json":
        msg.json_schema.schema_json = _schema_text(value, name)
    elif name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{name}: must be a non-empty list of non-empty strings", name)
        msg.choice.choices.extend(value)
    else:
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name}: must be a non-empty string", name)
        if name == "guided_regex":
            msg.regex = value
        else:
            msg.ebnf = value
    return msg


def _response_format(fmt: Any) -> pb.StructuredOutput | None:
    name = "response_format"
    if not isinstance(fmt, dict):
        raise bad_request(f"{name}: must be an object such as {{\"type\": \"json_object\"}}", name)
    kind = fmt.get("type")
    msg = pb.StructuredOutput(param=name)
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")                       # MLC's optional schema
        if schema is None:
            msg.json_object.SetInParent()
        else:
            msg.json_schema.schema_json = _schema_text(schema, f"{name}.schema")
        return msg
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(f"{name}.json_schema: must be an object with the schema and its name", name)
        strict = spec.get("strict", False)
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{name}.json_schema.strict: must be a boolean", name)
        if spec.get("schema") is None:
            msg.json_object.SetInParent()
        else:
            msg.json_schema.schema_json = _schema_text(spec["schema"], f"{name}.json_schema.schema")
            msg.json_schema.strict = bool(strict)
        return msg
    raise bad_request(f"{name}.type: must be one of text, json_object, json_schema; got {kind!r}", name)


def _schema_text(schema: Any, where: str) -> str:
    param = where.split(".", 1)[0]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{where}: not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{where}: a JSON schema must be an object", param)
    return json.dumps(schema, ensure_ascii=False)
