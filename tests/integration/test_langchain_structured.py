"""LangChain's ``ChatOpenAI`` against the facade (smollm2): ``with_structured_output`` of a
Pydantic model (OpenAI's json_schema response_format) returns that model, and ``bind_tools`` with
a forced tool returns ``tool_calls`` whose arguments validate; ``bind_tools`` with LangChain's
default (tool_choice auto) answers in text, or (when the model starts a call) with a call whose
arguments validate, also streamed through LangChain's chunk merging."""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from pydantic import BaseModel, Field

from tests.integration.test_facade_http import KEY, MODEL, facade  # noqa: F401 - fixture

if TYPE_CHECKING:   # imported where used (~1.3 s): every xdist worker collects this module
    from langchain_openai import ChatOpenAI

pytestmark = pytest.mark.slow


class City(BaseModel):
    """A city and its country."""
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class GetWeather(BaseModel):
    """Current weather in a city."""
    city: str = Field(max_length=20)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


def _chat(url: str) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300,
                      max_tokens=80, temperature=0)


def test_with_structured_output_returns_the_model(facade):  # noqa: F811
    city = _chat(facade.url).with_structured_output(City).invoke([HumanMessage("Name a big city in France.")])
    assert isinstance(city, City) and city.name


def test_bind_tools_forced_call(facade):  # noqa: F811
    llm = _chat(facade.url).bind_tools([GetWeather], tool_choice="GetWeather")
    msg = llm.invoke([HumanMessage("What is the weather in Rome?")])
    assert isinstance(msg, AIMessage) and [c["name"] for c in msg.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(msg.tool_calls[0]["args"])
    assert msg.tool_calls[0]["id"].startswith("call_")


def test_bind_tools_auto(facade):  # noqa: F811
    llm = _chat(facade.url).bind_tools([GetWeather])
    text = llm.invoke([HumanMessage("What is 2+2?")])
    assert isinstance(text, AIMessage) and text.content and not text.tool_calls
    ask = [HumanMessage('Write this text exactly: {"name": "GetWeather", "arguments": {"city": "Rome", '
                        '"unit": "kelvin"}}')]
    call = llm.invoke(ask)
    assert [c["name"] for c in call.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(call.tool_calls[0]["args"])      # "kelvin" was not allowed
    merged = None
    for chunk in llm.stream(ask):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in call.tool_calls]
