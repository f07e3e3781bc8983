"""The facade's request caps (``http_facade.limits``): each a 400 naming the parameter, checked
before the facade builds per-choice state or sends anything to the engine (the fake engine sees
no request), in the OpenAI and AFS dialects; configurable with ``--limits``."""
from __future__ import annotations

import pytest

from sluice.http_facade import protocol
from sluice.http_facade.errors import ApiError
from sluice.http_facade.limits import RequestLimits, parse_limits
from tests.unit.test_facade_app import _client
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def http(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port, limits=RequestLimits(max_prompt_bytes=4000, max_prompt_tokens=50,
                                                      max_tools_bytes=2000))
    yield client, fake
    await client.close()


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


CASES = [
    ("/v1/chat/completions", _chat(n=129), "n", "n: at most 128 choices per request, got 129"),
    ("/v1/chat/completions", _chat(n=2_000_000), "n", "n: at most 128 choices per request, got 2000000"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}, "n", "n: at most 128"),
    ("/v1/chat/completions", _chat(stop=[f"s{i}" for i in range(17)]), "stop", "stop: at most 16 stop strings"),
    ("/v1/chat/completions", _chat(stop=["x" * 257]), "stop", "stop: at most 256 characters per stop string"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "y" * 300}, "stop", "at most 256 characters"),
    ("/v1/chat/completions", _chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias",
     "logit_bias: at most 1024 entries, got 1025"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs",
     "top_logprobs: at most 20 alternatives per token"),
    ("/v1/completions", {"model": MODEL, "prompt": "é" * 2001}, "prompt", "prompt: at most 4000 bytes of UTF-8 text, got 4002"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(51))}, "prompt", "prompt: at most 50 token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 129}, "prompt", "prompt: at most 128 prompts per request"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a" * 2001}] * 2), "messages",
     "messages: at most 4000 bytes of message text"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a" * 4001}]}]),
     "messages", "messages: at most 4000 bytes"),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f", "description": "d" * 3000}}]),
     "tools", "tools: at most 2000 bytes of JSON"),
    ("/models/generate", {"model": MODEL, "inputs": "a" * 4001}, "inputs", "inputs: at most 4000 bytes"),
    ("/models/conversation", {"model": MODEL, "messages": [{"role": "user", "content": "a" * 4001}]}, "messages",
     "messages: at most 4000 bytes"),
    ("/models/conversation", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "functions": [{"name": "f", "description": "d" * 3000}]}, "functions",
     "functions: at most 2000 bytes of JSON"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), CASES,
                         ids=[f"{c[0]}:{c[2]}:{i}" for i, c in enumerate(CASES)])
async def test_caps_are_a_400_naming_the_parameter(http, path, body, param, message):
    client, fake = http
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    err = await resp.json()
    err = err["error"] if "error" in err and isinstance(err["error"], dict) else err
    text = err.get("message") or err.get("detail")
    assert message in text and err["param"] == param
    assert fake.requests == []        # nothing reached the engine


async def test_n_at_the_cap_is_served(http):
    client, fake = http
    resp = await client.post("/v1/chat/completions", json=_chat(n=128, max_tokens=1))
    assert resp.status == 200, await resp.text()
    assert len((await resp.json())["choices"]) == 128


def test_caps_come_before_any_per_item_work():
    """Two million stop strings are refused by their count, not by walking them: the list's
    items are not even strings, which a walk would report first."""
    body = {"model": MODEL, "prompt": "x", "stop": [object()] * 2_000_000}
    with pytest.raises(ApiError) as info:
        protocol.parse_completion(body)
    assert "stop: at most 16 stop strings, got 2000000" in str(info.value)


def test_limits_flag_parses_and_names_bad_keys():
    assert parse_limits("max_n=16; max_prompt_bytes=65_536").max_n == 16
    assert parse_limits("").max_n == 128
    with pytest.raises(ValueError, match="--limits: expected key=value"):
        parse_limits("max_q=1")
    with pytest.raises(ValueError, match="--limits: max_n: must be a positive integer"):
        parse_limits("max_n=0")


async def test_configured_cap_applies(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port, limits=parse_limits("max_n=2"))
    try:
        resp = await client.post("/v1/chat/completions", json=_chat(n=3))
        assert resp.status == 400 and "n: at most 2 choices" in (await resp.json())["error"]["message"]
    finally:
        await client.close()
