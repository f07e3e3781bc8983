"""Tool calling's pieces without a model: the facade's plan and schema, the response shapes, and
the engine's fallback prompt for templates without tools.

Proves: tool_choice required / named / none map to the constraint (a strict JSON Schema over
the list of calls, one call when named or parallel_tool_calls is false) and to the tools sent to
the template; "auto" and malformed choices are a 400 naming the parameter; a forced call cannot
be combined with response_format; every call the schema admits carries arguments valid for its
function (jsonschema as the oracle, on examples inside and outside); parse_calls and the stream
deltas are OpenAI-shaped (ids, index, name first, then arguments); the fallback prompt lists the
tools and writes assistant calls and tool results as text, and SmolLM2's template renders it.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sluice.engine.chat_template import render_chat_template
from sluice.engine.tool_prompt import FOOTER, fallback_messages, template_renders_tools
from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError
from sluice.http_facade.tools import call_deltas, parse_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "unit": {"enum": ["C", "F"]}},
                          "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **kw}


def _schema(plan) -> dict:
    sp = plan.requests[0].sampling
    assert sp.structured_output.param == "tools" and sp.structured_output.json_schema.strict
    return json.loads(sp.structured_output.json_schema.schema_json)


def test_required_admits_calls_of_any_tool_with_valid_arguments():
    plan = protocol.parse_chat(_chat(tool_choice="required"))
    assert plan.tool_calls and [t.function.name for t in plan.requests[0].chat.tools] == ["get_weather", "get_time"]
    schema = _schema(plan)
    good = [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
            {"name": "get_time", "arguments": {"tz": "UTC"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"unit": "C"}}],
                [{"name": "get_time", "arguments": {"city": "x"}}], [{"name": "nope", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_and_not_parallel_admit_exactly_one_call():
    named = _schema(protocol.parse_chat(_chat(tool_choice={"type": "function", "function": {"name": "get_time"}})))
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "CET"}}], named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "x"}}], named)
    single = _schema(protocol.parse_chat(_chat(tool_choice="required", parallel_tool_calls=False)))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"tz": "a"}}] * 2, single)


def test_none_offers_no_tools_and_constrains_nothing():
    plan = protocol.parse_chat(_chat(tool_choice="none"))
    req = plan.requests[0]
    assert not plan.tool_calls and not req.chat.tools and not req.sampling.HasField("structured_output")


@pytest.mark.parametrize("extra, param, message", [
    ({}, "tool_choice", '"auto" (the default when tools are given) is not supported yet'),
    ({"tool_choice": "auto"}, "tool_choice", "not supported yet"),
    ({"tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
     "cannot be combined with response_format"),
    ({"tools": "get_weather"}, "tools", "must be a list"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_parameter(extra, param, message):
    with pytest.raises(ApiError) as err:
        protocol.parse_chat(_chat(**extra))
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


def test_calls_are_openai_shaped_with_ids_and_stream_deltas():
    calls = parse_calls('[{"name": "get_weather", "arguments": {"city": "Zürich"}}, '
                        '{"name": "get_time", "arguments": {"tz": "UTC"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}
    deltas = call_deltas(calls)
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": calls[0]["function"]["arguments"]}}]}
    assert deltas[2]["tool_calls"][0]["index"] == 1 and len(deltas) == 4


def test_fallback_prompt_renders_tools_calls_and_results(smollm2_tokenizer):
    template = smollm2_tokenizer.chat_template
    assert not template_renders_tools(template)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    messages = fallback_messages(history, [WEATHER])
    assert messages[0]["role"] == "system" and FOOTER in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"] and '"city"' in messages[0]["content"]
    assert messages[2]["content"] == '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert "tool_calls" not in messages[2]
    assert messages[3] == {"role": "tool", "content": "Result of call call_1: 18 C, sunny"}
    text = render_chat_template(template, messages)
    assert "<|im_start|>tool\nResult of call call_1: 18 C, sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = fallback_messages([{"role": "system", "content": "Be brief."}, *history[:1]], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2
