"""The facade's structured-output parameters → the engine's typed ``StructuredOutput``.

Proves: response_format text / json_object / json_schema (schema, strict; no schema: any object)
and MLC's json_object + schema (object or JSON text), vLLM's guided_json / guided_regex /
guided_choice / guided_grammar land in the right oneof field with the parameter's name for
errors, on chat and completions alike; malformed values and two constraints at once are a 400
naming the parameter; the engine's conversion gives the same ``GrammarSpec`` back and names the
parameter in its errors.
"""
from __future__ import annotations

import json

import pytest

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.convert import sampling_from_proto, structured_to_proto
from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError, param_from_details

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _constraint(body: dict, completion: bool = False) -> pb.StructuredOutput | None:
    if completion:
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "hi"}
        plan = protocol.parse_completion(body)
    else:
        plan = protocol.parse_chat(body)
    sp = plan.requests[0].sampling
    return sp.structured_output if sp.HasField("structured_output") else None


@pytest.mark.parametrize("completion", [False, True])
@pytest.mark.parametrize("extra, kind, param, check", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "json_schema", "response_format", lambda m: json.loads(m.json_schema.schema_json) == SCHEMA and m.json_schema.strict),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json_schema", "response_format", lambda m: not m.json_schema.strict),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_object", "response_format", None),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json_schema", "response_format",
     lambda m: json.loads(m.json_schema.schema_json) == SCHEMA),
    ({"response_format": {"type": "json_object", "schema": json.dumps(SCHEMA)}}, "json_schema", "response_format",
     lambda m: json.loads(m.json_schema.schema_json) == SCHEMA),
    ({"guided_json": SCHEMA}, "json_schema", "guided_json", None),
    ({"guided_regex": "[0-9]+"}, "regex", "guided_regex", lambda m: m.regex == "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice", lambda m: list(m.choice.choices) == ["yes", "no"]),
    ({"guided_grammar": 'root ::= "a"'}, "ebnf", "guided_grammar", lambda m: m.ebnf == 'root ::= "a"'),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, "regex", "guided_regex", None),
])
def test_constraints_reach_the_engine_request(extra, kind, param, check, completion):
    msg = _constraint(_chat(**extra), completion)
    assert msg.WhichOneof("constraint") == kind and msg.param == param
    assert check is None or check(msg)


def test_no_constraint_and_text_leave_it_unset():
    assert _constraint(_chat()) is None
    assert _constraint(_chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format", "strict: must be a boolean"),
    ({"response_format": {"type": "json_object", "schema": "{oops"}}, "response_format", "not valid JSON"),
    ({"response_format": {"type": "json_object", "schema": [1]}}, "response_format", "must be an object"),
    ({"guided_regex": ""}, "guided_regex", "must be a non-empty string"),
    ({"guided_grammar": 3}, "guided_grammar", "must be a non-empty string"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one of"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json", "only one of"),
])
def test_malformed_constraints_are_a_400_naming_the_parameter(extra, param, message):
    with pytest.raises(ApiError) as err:
        protocol.parse_chat(_chat(**extra))
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


def test_engine_conversion_round_trips_and_names_the_parameter():
    for body in (_chat(guided_regex="[a-z]"), _chat(guided_choice=["x", "y"]),
                 _chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}),
                 _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}])):
        sp = protocol.parse_chat(body).requests[0].sampling
        spec = sampling_from_proto(sp).structured
        assert structured_to_proto(spec) == sp.structured_output
    bad = pb.SamplingParams(structured_output=pb.StructuredOutput(param="guided_choice", choice=pb.ChoiceConstraint()))
    with pytest.raises(ValueError, match=r"^sampling\.guided_choice: needs at least one choice") as err:
        sampling_from_proto(bad)
    assert param_from_details(str(err.value)) == "guided_choice"
    with pytest.raises(ValueError, match=r"^sampling\.structured_output: a constraint .* is required"):
        sampling_from_proto(pb.SamplingParams(structured_output=pb.StructuredOutput()))
    with pytest.raises(ValueError, match=r"^sampling\.min_tokens: cannot be combined with guided_regex"):
        sampling_from_proto(pb.SamplingParams(min_tokens=2, structured_output=pb.StructuredOutput(
            param="guided_regex", regex="a")))
