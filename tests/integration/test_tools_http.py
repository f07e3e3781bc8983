"""Tool calling through the real facade and engine (smollm2, whose template has no tools: the
fallback prompt), with the official OpenAI SDK.

Proves: tool_choice "required" and a named function return ``tool_calls`` with ids,
``finish_reason: "tool_calls"``, no content, and arguments that validate against the function's
schema (jsonschema), also for n = 2 at temperature 1; parallel_tool_calls false gives exactly one
call; streaming sends index / id / name first, then argument fragments that join into the same
valid arguments, and ends with "tool_calls"; a conversation with the assistant's call and the
``role: "tool"`` result renders and gets an answer. tool_choice "auto" (the default): a question
no tool answers gets text; a call the model starts (here it copies a call with wrong arguments
from the prompt) is held to a tool's schema and returned as ``tool_calls``, streamed and not
alike; MLC's two function-calling examples (from MLC-LLM's REST API documentation) run as
written, with the model's name and our port, and answer well-formed (the 135M model answers them
in text, so they are also run with tool_choice "required", which must give valid calls).
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


def test_auto_answers_in_text_when_no_call_is_started(sdk):
    resp = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       tools=TOOLS, max_tokens=20, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert "4" in choice.message.content


COPY = [{"role": "user", "content": 'Write this text exactly: {"name": "get_weather", "arguments": '
                                    '{"town": "Paris", "unit": "kelvin"}}'}]


def test_auto_holds_a_started_call_to_the_schema_streamed_and_not(sdk):
    resp = sdk.chat.completions.create(model=MODEL, messages=COPY, tools=TOOLS, max_tokens=60, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == \
        ["get_weather"]
    _check_calls(choice.message.tool_calls)    # "town" and "kelvin" were not allowed
    stream = sdk.chat.completions.create(model=MODEL, messages=COPY, tools=TOOLS, max_tokens=60, temperature=0,
                                         stream=True)
    content, calls, finish = "", {}, []
    for chunk in stream:
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
        if c.finish_reason:
            finish.append(c.finish_reason)
    assert finish == ["tool_calls"] and (content or None) == choice.message.content
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == \
        [(x.function.name, json.loads(x.function.arguments)) for x in choice.message.tool_calls]


# MLC's function-calling examples (MLC-LLM's REST API documentation), as written but for the
# model's name and the URL.
MLC_TOOLS = [{"type": "function", "function": {
    "name": "get_current_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}]
MLC_ASK = "What is the current weather in Pittsburgh, PA in fahrenheit?"
MLC_ASK_STREAM = "What is the current weather in Pittsburgh, PA and Tokyo, JP in fahrenheit?"


def _mlc_valid(calls) -> None:
    for c in calls:
        assert c["id"].startswith("call_") and c["function"]["name"] == "get_current_weather"
        jsonschema.validate(json.loads(c["function"]["arguments"]), MLC_TOOLS[0]["function"]["parameters"])


# "required" greedy: at the examples' default temperature (1) a string argument may run past
# max_tokens, which is a well-formed "length" but not the call this variant exists to show. One
# call (parallel_tool_calls false): greedy SmolLM2 may repeat its call until max_tokens, and
# whether it does turns on the last bits of its float arithmetic.
@pytest.mark.parametrize("extra", [{}, {"tool_choice": "required", "max_tokens": 150, "temperature": 0,
                                        "parallel_tool_calls": False}],
                         ids=["as-written", "required"])
def test_mlc_function_calling_examples(facade, extra):  # noqa: F811
    import requests

    url, headers = facade.url + "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    payload = {"model": MODEL, "messages": [{"role": "user", "content": MLC_ASK}], "stream": False,
               "tools": MLC_TOOLS, "max_tokens": 80, **extra}
    r = requests.post(url, json=payload, headers=headers, timeout=300)
    assert r.status_code == 200
    message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    if extra:
        assert finish == "tool_calls" and message["tool_calls"]
    if message["tool_calls"]:
        _mlc_valid(message["tool_calls"])
        print(f"{message['tool_calls'][0]['function']}")
    else:
        assert finish in ("stop", "length") and message["content"]

    payload = {**payload, "stream": True, "messages": [{"role": "user", "content": MLC_ASK_STREAM}]}
    pieces, calls, finishes = [], {}, []
    with requests.post(url, json=payload, headers=headers, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["delta"].get("content") or "")   # the example prints these
            for d in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(d["index"], {"id": d.get("id"), "function": {"name": None, "arguments": ""}})
                entry["function"]["name"] = entry["function"]["name"] or d["function"].get("name")
                entry["function"]["arguments"] += d["function"].get("arguments") or ""
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    assert len(finishes) == 1
    if calls:
        # sampled (as written): text may follow a call until max_tokens
        assert finishes == ["tool_calls"] or (not extra and finishes == ["length"])
        _mlc_valid(list(calls.values()))
    else:
        assert not extra and finishes[0] in ("stop", "length") and "".join(pieces)
