"""The official ``openai`` SDK against the facade over a real engine (smollm2): chat with and
without streaming (include_usage), completions, models.list, n = 2, the same seed twice giving the
same text, logprobs, the litserve seed's OpenAI-client example as written (host/port/model
changed), and errors arriving as the SDK's typed exceptions with the right param / code."""
from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.integration.test_facade_http import KEY, MODEL, facade  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def sdk(facade) -> OpenAI:  # noqa: F811
    return OpenAI(base_url=facade.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_chat_non_streaming(sdk):
    resp = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.system_fingerprint
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0 and 0 < resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_usage_matches_non_streaming(sdk):
    greedy = dict(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    whole = sdk.chat.completions.create(**greedy).choices[0].message.content
    chunks = list(sdk.chat.completions.create(**greedy, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completions_and_models(sdk):
    resp = sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.completion_tokens <= 6
    assert [m.id for m in sdk.models.list()] == [MODEL]


def test_n_seed_and_logprobs(sdk):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6,
              temperature=1.0, seed=1234)
    a = sdk.chat.completions.create(**kw, n=2)
    b = sdk.chat.completions.create(**kw, n=2)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    lp = sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, logprobs=True,
                                     top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == lp.choices[0].message.content


def test_litserve_openai_client_example(facade):  # noqa: F811
    client = OpenAI(
        base_url=f"{facade.url}/v1",  # Specify your LitServe endpoint
        api_key=KEY,  # The API key is required, but it can be a placeholder in this context
    )
    response = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "How are you?"},
        ],
    )
    print(response)
    assert response.choices[0].message.content


def test_errors_are_typed(sdk, facade):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=HI, tools=[{"type": "function", "function": {"name": "f"}}],
                                    tool_choice="sometimes")
    assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="hello " * 9000, max_tokens=4)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-nope", messages=HI, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=facade.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # The engine serves the packaged embedding model by default: the SDK gets a real vector.
    emb = sdk.embeddings.create(model=MODEL, input="hello")
    assert len(emb.data) == 1 and len(emb.data[0].embedding) == 384
