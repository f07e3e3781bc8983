"""LangChain's ``ChatOpenAI`` (package ``langchain-openai``) with ``base_url`` at the facade over a
real engine (smollm2): ``invoke`` answers an assistant message with the finish reason and token
usage the facade reported; ``stream`` yields the same greedy text in several chunks, with usage on
the stream; a seeded sampled ``invoke`` repeats exactly; and a facade error reaches LangChain as the
SDK's typed exception naming the parameter."""
from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage

from tests.integration.test_facade_http import KEY, MODEL, facade  # noqa: F401 - fixture

if TYPE_CHECKING:   # imported where used (~1.3 s): every xdist worker collects this module
    from langchain_openai import ChatOpenAI

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
MESSAGES = [SystemMessage("You are a helpful assistant."), HumanMessage("Name three colours.")]


def _chat(url: str, **kw) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                      max_tokens=MAX_TOKENS, **kw)


def test_invoke_and_stream_give_the_same_greedy_answer(facade):  # noqa: F811
    llm = _chat(facade.url, temperature=0, stream_usage=True)

    answer = llm.invoke(MESSAGES)
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["model_name"] == MODEL
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    usage = answer.usage_metadata
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    chunks = list(llm.stream(MESSAGES))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert sum(1 for c in chunks if c.content) >= 2, "the answer did not arrive in several chunks"
    assert "".join(c.content for c in chunks) == answer.content
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert merged.usage_metadata["output_tokens"] == usage["output_tokens"]
    assert merged.usage_metadata["input_tokens"] == usage["input_tokens"]
    assert merged.response_metadata["finish_reason"] == answer.response_metadata["finish_reason"]


def test_seeded_sampling_repeats_and_errors_are_typed(facade):  # noqa: F811
    llm = _chat(facade.url, temperature=1.0, seed=4242)
    prompt = [HumanMessage("Invent a name for a cat.")]
    first = llm.invoke(prompt).content
    assert first and llm.invoke(prompt).content == first

    with pytest.raises(openai.BadRequestError) as info:
        _chat(facade.url, temperature=-1).invoke(prompt)
    assert info.value.body["param"] == "temperature"
