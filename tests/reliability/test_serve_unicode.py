"""CJK and emoji stream without U+FFFD through every streaming dialect (issue #16), on a real
``sluice serve`` of the random-weight 2-layer model with SmolLM2's byte-level tokenizer.

A grammar holds the output to CJK characters and emoji (``guided_regex``), sampled at
temperature 1, so the random model picks byte-level tokens that split 3- and 4-byte characters
between them. Proves, for OpenAI completions and chat: no streamed delta holds U+FFFD; the deltas
join to exactly the non-streamed answer of the same seed; and characters really were split: the
stream has fewer text-bearing deltas than tokens (the detokenizer held the partial bytes back),
so the check is not vacuous. AFS has no grammar parameter, and the random model writes no CJK by
itself; its per-token records are checked on the default model answering in Chinese
(``tests/integration/test_afs_http.py``).
"""
from __future__ import annotations

import pytest
import requests

from tests.reliability.serve import Serve, sse, wait_idle

pytestmark = pytest.mark.timeout(300)

FFFD = "\ufffd"
WIDE = "(日本語|中文字|한국어|😀|🎉|🚀|👍🏽|漢字)"
REGEX = f"{WIDE}{{4,8}}"


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_smollm2):
    s = Serve(tiny_smollm2, tmp_path_factory.mktemp("unicode") / "serve.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _model(serve: Serve) -> str:
    return requests.get(serve.url + "/v1/models", timeout=5).json()["data"][0]["id"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_streams_split_characters_without_replacement(serve, route):
    body = {"model": _model(serve), "max_tokens": 250, "temperature": 1.0, "seed": 7, "guided_regex": REGEX}
    body |= {"prompt": "Write:"} if "chat" not in route else {"messages": [{"role": "user", "content": "Write:"}]}
    whole = serve.post(route, json=body).json()
    assert whole["choices"][0]["finish_reason"] == "stop", whole     # the grammar ended it, not max_tokens
    expected = whole["choices"][0]["text" if "chat" not in route else "message"]
    expected = expected if "chat" not in route else expected["content"]
    with serve.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                    stream=True) as r:
        events = [e for e in sse(r) if e != "[DONE]"]
    pieces = [(c.get("text") if "chat" not in route else c["delta"].get("content")) or ""
              for e in events for c in e["choices"]]
    tokens = events[-1]["usage"]["completion_tokens"]
    assert all(FFFD not in p for p in pieces), repr(pieces)
    assert "".join(pieces) == expected and FFFD not in expected and expected
    assert sum(1 for p in pieces if p) < tokens, (pieces, tokens)     # some tokens were partial characters
    wait_idle(serve)
