"""Tool calling's pieces without a model: the facade's plan and schema, the response shapes, and
the engine's fallback prompt for templates without tools.

Proves: tool_choice required / named / none map to the constraint (a strict JSON Schema over
the list of calls, one call when named or parallel_tool_calls is false) and to the tools sent to
the template; "auto" (also the default) maps to triggered tags, one per tool, that begin where a
call begins, with stop_after_first when parallel_tool_calls is false; malformed choices are a 400
naming the parameter; tool calls cannot be combined with response_format; every call the schema
admits carries arguments valid for its function (jsonschema as the oracle, on examples inside and
outside); the call scanner splits text and calls the same way whole and streamed in pieces of any
size (lists, Hermes tags, fences, text around calls, a call cut short, JSON that is no call), with
OpenAI-shaped deltas (ids, index, name first, then arguments); the fallback prompt lists the tools
and writes assistant calls and tool results as text, and SmolLM2's template renders it.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from sluice.engine.chat_template import render_chat_template
from sluice.engine.tool_prompt import FOOTER, fallback_messages, template_renders_tools
from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError
from sluice.http_facade.tools import TRIGGER, CallScanner, split_calls

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


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "auto"}, {"parallel_tool_calls": False}])
def test_auto_constrains_each_call_the_model_starts(extra):
    plan = protocol.parse_chat(_chat(**extra))
    assert plan.tool_calls == "auto" and plan.tool_names == ("get_weather", "get_time")
    so = plan.requests[0].sampling.structured_output
    assert so.param == "tools" and so.WhichOneof("constraint") == "triggered_tags"
    tags = so.triggered_tags
    assert list(tags.triggers) == [TRIGGER] and tags.stop_after_first == (extra.get("parallel_tool_calls") is False)
    assert [t.begin for t in tags.tags] == ['{"name": "get_weather", "arguments": ',
                                           '{"name": "get_time", "arguments": ']
    assert all(t.end == "}" for t in tags.tags)
    assert json.loads(tags.tags[0].schema_json) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_object"}}, "tools", "tool calls (tool_choice auto) cannot be combined"),
    ({"tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
     "tool calls (tool_choice forced) cannot be combined with response_format"),
    ({"tools": "get_weather"}, "tools", "must be a list"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_parameter(extra, param, message):
    with pytest.raises(ApiError) as err:
        protocol.parse_chat(_chat(**extra))
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


NAMES = ("get_weather", "get_time")
W = '{"name": "get_weather", "arguments": {"city": "Z\u00fcrich"}}'
T = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


@pytest.mark.parametrize("text, content, calls", [
    ("Hello there.", "Hello there.", []),
    (f"[{W}, {T}]", None, ["get_weather", "get_time"]),
    (f"Let me look. [{W}]", "Let me look.", ["get_weather"]),
    (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>", None, ["get_weather", "get_time"]),
    (f"```json\n[{T}]\n```", None, ["get_time"]),
    (f"[{W}] and then some words", "and then some words", ["get_weather"]),
    ('cut short [{"name": "get_weather", "arguments": {"city": "Pa', 'cut short [{"name": "get_weather", '
     '"arguments": {"city": "Pa', []),
    ('a list [1, 2], an object {"x": 1} and {"name": "other", "arguments": {}}',
     'a list [1, 2], an object {"x": 1} and {"name": "other", "arguments": {}}', []),
    ("ends with [", "ends with [", []),
])
def test_call_scanner_splits_text_and_calls_alike_whole_and_streamed(text, content, calls):
    whole_content, whole_calls = split_calls(text, NAMES)
    assert whole_content == content and [c["function"]["name"] for c in whole_calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in whole_calls)
    assert len({c["id"] for c in whole_calls}) == len(calls)
    for size in (1, 2, 5, 11, len(text)):
        scanner, deltas = CallScanner(NAMES), []
        for i in range(0, len(text), size):
            deltas += scanner.feed(text[i:i + size])
        deltas += scanner.finish()
        streamed = "".join(d.get("content", "") for d in deltas)
        assert (streamed if streamed.strip() else None) == content, size
        assert [c["function"] for c in scanner.calls] == [c["function"] for c in whole_calls]
        opened = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        assert [d["index"] for d in opened] == list(range(len(calls)))


def test_call_deltas_are_openai_shaped():
    scanner = CallScanner(NAMES)
    deltas = scanner.feed(f"[{W}, ") + scanner.feed(T + "]") + scanner.finish()
    calls = scanner.calls
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": calls[0]["function"]["arguments"]}}]}
    assert deltas[2]["tool_calls"][0]["index"] == 1 and len(deltas) == 4


def test_a_call_is_sent_as_soon_as_it_is_complete_and_text_before_it_at_once():
    scanner = CallScanner(NAMES)
    assert scanner.feed("Sure.") == [{"content": "Sure."}]
    assert scanner.feed(" [") == []                      # may lead into a call
    assert scanner.feed(W[:20]) == []                    # a call has begun
    opened = scanner.feed(W[20:])
    assert [list(d) for d in opened] == [["tool_calls"], ["tool_calls"]]
    assert scanner.feed("]") == [] and scanner.finish() == []


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
