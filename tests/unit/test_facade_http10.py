"""HTTP/1.0 clients: a streaming request is answered as SSE over a body that ends with the
connection (``Connection: close``, no ``Transfer-Encoding``, which HTTP/1.0 does not have), in
the OpenAI and the AFS dialect; non-streaming answers are unchanged. It used to be a 500."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.test_facade_app import _client
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(60)


async def _raw_request(port: int, path: str, body: dict, version: str = "1.0") -> tuple[str, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(-1), 20)    # to EOF: the server must close
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    return status, headers, payload


@pytest.fixture
async def port(fake_engine):  # noqa: F811
    _, engine_port = fake_engine
    client = await _client(engine_port)
    yield client.port
    await client.close()


@pytest.mark.parametrize(("path", "body", "last"), [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "stream": True}, b"data: [DONE]\n\n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}, b"data: [DONE]\n\n"),
    ("/models/generate", {"model": MODEL, "inputs": "hi", "stream": True,
                          "parameters": {"max_new_tokens": 3}}, None),
])
async def test_http10_streaming_is_sse_until_close(port, path, body, last):
    status, headers, payload = await _raw_request(port, path, body)
    assert status.split()[1] == "200", (status, payload[:300])
    assert "transfer-encoding" not in headers and headers["connection"].lower() == "close"
    assert headers["content-type"].startswith("text/event-stream")
    events = [e for e in payload.split(b"\n\n") if e.strip()]
    assert len(events) >= 3 and all(e.startswith((b"data: ", b"event: ")) for e in events)
    if last is not None:
        assert payload.endswith(last)


async def test_http11_streaming_stays_chunked(port):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    raw = await asyncio.wait_for(reader.read(-1), 20)
    writer.close()
    assert b"Transfer-Encoding: chunked" in raw.partition(b"\r\n\r\n")[0]


async def test_http10_non_streaming_has_a_length(port):
    status, headers, payload = await _raw_request(
        port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert status.split()[1] == "200" and int(headers["content-length"]) == len(payload)
    assert json.loads(payload)["choices"][0]["finish_reason"] == "length"
