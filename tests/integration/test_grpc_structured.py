"""Structured output over gRPC with the engine's client SDK (smollm2 engine process).

Proves: the typed ``SamplingParams.structured_output`` constrains the output (regex, choice, a
JSON Schema that validates, EBNF), streaming deltas joined equal the constrained text; a
constraint that does not compile is INVALID_ARGUMENT whose message names the ``param`` the
caller gave (or structured_output), an empty constraint is INVALID_ARGUMENT, and the engine is
idle afterwards (nothing left allocated).
"""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from sluice.engine.client import EngineClient, SamplingOptions
from sluice.engine.rpc import engine_pb2 as pb
from tests.integration.test_grpc_errors import _assert_idle, _status_of

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}


def _opts(constraint: pb.StructuredOutput, **kw) -> SamplingOptions:
    return SamplingOptions(max_tokens=40, temperature=kw.pop("temperature", 1.0), seed=9,
                           structured_output=constraint, **kw)


def test_typed_constraints_hold(client: EngineClient) -> None:
    msgs = [{"role": "user", "content": "Pick a colour and a count."}]
    out = client.chat(msgs, _opts(pb.StructuredOutput(regex="[a-z]{3,6} [0-9]"))).collect()[0]
    assert re.fullmatch("[a-z]{3,6} [0-9]", out.text) and out.finish_reason == "stop"
    out = client.chat(msgs, _opts(pb.StructuredOutput(choice=pb.ChoiceConstraint(choices=["left", "right"])))
                      ).collect()[0]
    assert out.text in ("left", "right")
    schema = pb.StructuredOutput(json_schema=pb.JsonSchemaConstraint(schema_json=json.dumps(SCHEMA), strict=True))
    out = client.chat(msgs, _opts(schema)).collect()[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    out = client.generate("Answer:", _opts(pb.StructuredOutput(ebnf='root ::= ("yes" | "no") "!"'))).collect()[0]
    assert out.text in ("yes!", "no!")
    begin = '{"name": "paint", "arguments": '
    calls = pb.StructuredOutput(triggered_tags=pb.TriggeredTagsConstraint(triggers=['{"name"'], tags=[
        pb.TriggeredTag(begin=begin, schema_json=json.dumps(SCHEMA), end="}")], stop_after_first=True))
    line = 'Copy: {"name": "paint", "arguments": {"colour": "blue", "size": 3}}\n'
    out = client.generate(line * 3 + "Copy:", _opts(calls, temperature=0.0)).collect()[0]
    assert begin in out.text and out.text.endswith("}") and out.finish_reason == "stop"   # the end after it
    jsonschema.validate(json.loads(out.text[out.text.index(begin) + len(begin):-1]), SCHEMA)   # held to SCHEMA
    stream = client.chat(msgs, _opts(schema, temperature=0.0))
    pieces = [d.text for d in stream]
    assert pieces and json.loads("".join(pieces)) is not None
    _assert_idle(client)


@pytest.mark.parametrize("constraint, prefix", [
    (pb.StructuredOutput(regex="(open", param="guided_regex"), "guided_regex: invalid regex"),
    (pb.StructuredOutput(ebnf="start ::= \"a\""), "structured_output: invalid grammar"),
    (pb.StructuredOutput(json_schema=pb.JsonSchemaConstraint(schema_json='{"type": 5}')),
     "structured_output: invalid JSON schema"),
    (pb.StructuredOutput(json_schema=pb.JsonSchemaConstraint(schema_json="{")),
     "sampling.structured_output: the JSON schema is not valid JSON"),
    (pb.StructuredOutput(param="x"), "sampling.x: a constraint"),
    (pb.StructuredOutput(param="tools", triggered_tags=pb.TriggeredTagsConstraint(
        triggers=["<"], tags=[pb.TriggeredTag(begin="{", schema_json="{}", end="}")])),
     "sampling.tools: tags[0].begin '{' must start with exactly one trigger"),
    (pb.StructuredOutput(triggered_tags=pb.TriggeredTagsConstraint(
        triggers=["{"], tags=[pb.TriggeredTag(begin="{", schema_json='{"type": 5}', end="}")])),
     "structured_output: invalid tool call schema"),
])
def test_bad_constraints_are_invalid_argument(client: EngineClient, constraint, prefix) -> None:
    err = _status_of(lambda: client.generate("Hello", _opts(constraint)).collect())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith(prefix), err.message
    _assert_idle(client)
