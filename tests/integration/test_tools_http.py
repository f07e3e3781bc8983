"""Tool calling through the real facade and engine (smollm2, whose template has no tools: the
fallback prompt), with the official OpenAI SDK.

Proves: tool_choice "required" and a named function return ``tool_calls`` with ids,
``finish_reason: "tool_calls"``, no content, and arguments that validate against the function's
schema (jsonschema), also for n = 2 at temperature 1; parallel_tool_calls false gives exactly one
call; streaming sends index / id / name first, then argument fragments that join into the same
valid arguments, and ends with "tool_calls"; a conversation with the assistant's call and the
``role: "tool"`` result renders and gets an answer; "auto" is still a 400 naming tool_choice.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.integration.test_facade_http import KEY, MODEL, facade  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}
TIME_ARGS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture
def sdk(facade) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=facade.url + "/v1", api_key=KEY, max_retries=0, timeout=400)


def _check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_and_named_calls_validate(sdk):
    resp = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=4, n=2)
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    named = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls(calls)
    parallel = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0)
    assert parallel.choices[0].finish_reason == "tool_calls"
    _check_calls(parallel.choices[0].message.tool_calls)


def test_streamed_tool_call_deltas(sdk):
    stream = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    finish = []
    for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:   # the first delta of a call: its id and name, no arguments yet
                assert d.id.startswith("call_") and d.function.name and not d.function.arguments
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None
                calls[d.index]["arguments"] += d.function.arguments or ""
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert finish == ["tool_calls"] and calls
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_tool_result_round_trip(sdk):
    first = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    answer = sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=30, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_auto_is_refused_naming_tool_choice(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8)
    assert err.value.body["param"] == "tool_choice" and "auto" in err.value.body["message"]
