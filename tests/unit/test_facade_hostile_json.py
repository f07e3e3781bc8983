"""Hostile and malformed bodies on every dialect: one decoding path (``http_facade.json_body``)
turns each into that dialect's 400 (AFS: its own body shape), never a 500 with a trace; a body
sent without a JSON Content-Type is a 415; fields of the wrong type are refused before use. The
fake engine sees no request in any of these cases."""
from __future__ import annotations

import pytest

from sluice.http_facade.json_body import decode_json
from tests.unit.test_facade_app import _client
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)
JSON = {"Content-Type": "application/json"}
DEEP = 100_000


@pytest.fixture
async def http(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port)
    yield client, fake
    await client.close()


def _raw(template: str) -> bytes:
    return template.replace("MODEL", MODEL).encode()


CHAT = '{"model": "MODEL", "messages": [{"role": "user", "content": CONTENT}], "max_tokens": 2}'
HOSTILE = {
    "deep arrays": b"[" * DEEP + b"]" * DEEP,
    "deep objects": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "deep inside a field": _raw(CHAT.replace("CONTENT", "[" * DEEP + "]" * DEEP)),
    "5000-digit int": _raw(CHAT.replace("CONTENT", '"hi"')[:-1] + ', "n": ' + "7" * 5000 + "}"),
    "NaN": _raw(CHAT.replace("CONTENT", '"hi"')[:-1] + ', "temperature": NaN}'),
    "lone surrogate in content": _raw(CHAT.replace("CONTENT", '"a\\ud800"')),
    "lone low surrogate": _raw(CHAT.replace("CONTENT", '"\\udc00b"')),
    "surrogate in a key": _raw(CHAT.replace("CONTENT", '"hi"')[:-1] + ', "\\ud800": 1}'),
    "not UTF-8": b'{"model": "\xff\xfe"}',
    "truncated": b'{"model": ',
    "not an object": b"[1, 2]",
    "empty": b"",
}
ROUTES = {
    "/v1/chat/completions": None,
    "/v1/completions": '{"model": "MODEL", "prompt": "a\\ud800"}',
    "/models/generate": '{"model": "MODEL", "inputs": "a\\ud800"}',
    "/models/conversation": '{"model": "MODEL", "messages": [{"role": "user", "content": "a\\udfff"}]}',
    "/v1/embeddings": '{"model": "MODEL", "input": ["a\\ud800"]}',
}


def _message(path: str, body: dict) -> str:
    return body["error"] if path.startswith("/models/") else body["error"]["message"]


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_bodies_are_the_dialects_400(http, path, case):
    client, fake = http
    resp = await client.post(path, data=HOSTILE[case], headers=JSON)
    assert resp.status == 400, (case, resp.status, (await resp.text())[:300])
    body = await resp.json()
    if path.startswith("/models/"):
        assert set(body) == {"status_code", "error", "detail", "param"} and body["status_code"] == 400
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in _message(path, body)
    assert fake.requests == []


@pytest.mark.parametrize("path", list(ROUTES))
async def test_a_lone_surrogate_in_the_routes_own_text_field_is_a_400(http, path):
    client, fake = http
    raw = ROUTES[path] or CHAT.replace("CONTENT", '"x\\ud83d"')
    resp = await client.post(path, data=_raw(raw), headers=JSON)
    assert resp.status == 400, await resp.text()
    assert "lone UTF-16 surrogate" in _message(path, await resp.json())
    assert fake.requests == []


async def test_paired_surrogates_are_a_character(http):
    client, fake = http
    resp = await client.post("/v1/completions", headers=JSON,
                             data=_raw('{"model": "MODEL", "prompt": "smile \\ud83d\\ude00", "max_tokens": 1}'))
    assert resp.status == 200, await resp.text()
    assert fake.requests[0].text == "smile \U0001F600"


@pytest.mark.parametrize("stop", ['"a\\ud800"', '["ok", "\\udbff"]'])
async def test_a_lone_surrogate_in_stop_is_a_400(http, stop):
    client, _ = http
    raw = CHAT.replace("CONTENT", '"hi"')[:-1] + f', "stop": {stop}}}'
    resp = await client.post("/v1/chat/completions", data=_raw(raw), headers=JSON)
    assert resp.status == 400 and "surrogate" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("role", [{}, ["user"], 1, None, True])
async def test_a_role_of_the_wrong_type_is_refused_in_both_parsers(http, role):
    client, fake = http
    resp = await client.post("/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": role, "content": "hi"}]})
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["param"] == "messages[0].role"
    resp = await client.post("/models/conversation",
                             json={"model": MODEL, "messages": [{"role": role, "content": "hi"}]})
    # AFS answers a body that does not validate with 422 (afs_errors), its dialect's "bad request"
    assert resp.status == 422, await resp.text()
    assert (await resp.json())["param"] == "messages[0].role"
    assert fake.requests == []


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/models/generate", "/v1/embeddings"])
async def test_json_only_with_a_json_content_type(http, path, content_type):
    client, fake = http
    raw = _raw(CHAT.replace("CONTENT", '"hi"'))
    headers = {"Content-Type": content_type} if content_type else {}
    resp = await client.post(path, data=raw, headers=headers,
                             skip_auto_headers=() if content_type else ("Content-Type",))
    assert resp.status == 415, await resp.text()
    assert "Content-Type: application/json" in _message(path, await resp.json())
    assert fake.requests == []


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
async def test_json_content_types_are_accepted(http, content_type):
    client, _ = http
    resp = await client.post("/v1/chat/completions", data=_raw(CHAT.replace("CONTENT", '"hi"')),
                             headers={"Content-Type": content_type})
    assert resp.status == 200, await resp.text()


def test_decoding_is_quick_on_the_worst_bodies():
    import time

    for raw in HOSTILE.values():
        t0 = time.perf_counter()
        with pytest.raises(Exception):
            decode_json(raw)
        assert time.perf_counter() - t0 < 0.5
