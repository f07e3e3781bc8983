"""Structured output through the real facade and engine (smollm2), with the official OpenAI SDK.

Proves: ``client.beta.chat.completions.parse(response_format=PydanticModel)`` returns a parsed
object of that model; ``response_format`` json_schema outputs parse and validate, streaming and
not; json_object gives a JSON object; ``guided_regex`` / ``guided_choice`` (``extra_body``) on
chat and on completions match, streamed too; MLC's ``response_format.schema``; a schema, regex or
grammar that does not compile is a 400 naming the parameter (the SDK's BadRequestError), and
the server keeps serving after it.
"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.integration.test_facade_http import KEY, MODEL, facade  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person named Ann as JSON."}]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


@pytest.fixture
def sdk(facade) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=facade.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_sdk_parse_with_a_pydantic_model(sdk):
    resp = sdk.beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=60,
                                           temperature=0)
    msg = resp.choices[0].message
    assert isinstance(msg.parsed, Person) and resp.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(msg.content) == msg.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(sdk, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    if stream:
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=60,
                                                  temperature=1.0, seed=3, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"]
    else:
        resp = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=60,
                                           temperature=1.0, seed=3, n=2)
        assert [c.finish_reason for c in resp.choices] == ["stop", "stop"]
        text = resp.choices[1].message.content
        jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_mlc_schema(sdk):
    resp = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=80, temperature=0)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:   # an open object may run to max_tokens; what came is still a JSON object's prefix
        assert resp.choices[0].message.content.startswith("{")
    mlc = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object", "schema": json.dumps(PERSON)})
    jsonschema.validate(json.loads(mlc.choices[0].message.content), PERSON)


def test_guided_regex_and_choice_on_chat_and_completions(sdk):
    regex = r"[A-Z][a-z]{2,7} is [0-9]{1,2}"
    chat = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=1.0, seed=1,
                                       extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, chat.choices[0].message.content)
    comp = sdk.completions.create(model=MODEL, prompt="The weather today is", max_tokens=10, temperature=1.0,
                                  seed=2, extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert comp.choices[0].text in ("sunny", "rainy", "cloudy") and comp.choices[0].finish_reason == "stop"
    stream = sdk.completions.create(model=MODEL, prompt="Count: ", max_tokens=12, temperature=0, stream=True,
                                    extra_body={"guided_regex": "[0-9]( [0-9]){3}"})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch("[0-9]( [0-9]){3}", text)


@pytest.mark.parametrize("extra, param, message", [
    ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "start ::= \"a\""}, "guided_grammar", "invalid grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_choice": ["a"], "min_tokens": 3}, "min_tokens", "cannot be combined with guided_choice"),
])
def test_bad_constraints_are_a_400_naming_the_parameter(sdk, extra, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body=extra)
    body = err.value.body
    assert err.value.status_code == 400 and body["param"] == param and message in body["message"]
    ok = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body={"guided_choice": ["ok"]})
    assert ok.choices[0].message.content == "ok"
