"""The facade's HTTP layer over a scripted in-process gRPC engine (see test_facade_fake_engine):
response and chunk shapes as the OpenAI reference (role on the first delta, a finish chunk per
choice, the usage chunk, [DONE], one event per HTTP chunk), n > 1 and several prompts, echo and
both logprobs shapes; every error status (400 with param, 401, 404, 405, 413, 429 + Retry-After,
503, context_length_exceeded, 500 without a trace, an SSE error event mid-stream); that a client
disconnect cancels the engine call; auth on every route; CORS; metrics; docs."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sluice.http_facade.app import build_app
from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.cors import CorsPolicy
from sluice.http_facade.openapi import ENDPOINTS
from sluice.http_facade.state import STATE_KEY, FacadeConfig
from tests.unit.test_facade_fake_engine import MODEL, fake_engine  # noqa: F401 - fixture

KEY = "sk-test-123"
JSON = {"Content-Type": "application/json"}


async def _client(port: int, **config) -> TestClient:
    app = build_app(FacadeConfig(engine_addr=f"127.0.0.1:{port}", **config))
    client = TestClient(TestServer(app, handler_cancellation=True))
    await client.start_server()
    return client


@pytest.fixture
async def http(fake_engine):  # noqa: F811
    fake, port = fake_engine
    client = await _client(port, max_body_bytes=4096, enable_tracing=True)
    yield client, fake
    await client.close()


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


async def _sse(resp) -> list:
    """Events, each read as its own HTTP chunk (what iter_content(chunk_size=None) sees)."""
    events = []
    buffer = b""
    async for data, end_of_chunk in resp.content.iter_chunks():
        buffer += data
        if end_of_chunk:
            text = buffer.decode()
            assert text.startswith("data: ") and text.endswith("\n\n") and text.count("data: ") == 1, text
            events.append(text[6:-2] if text[6:-2] == "[DONE]" else json.loads(text[6:]))
            buffer = b""
    return events


async def _error(resp, status: int, param=None, code=None) -> dict:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    assert "Traceback" not in err["message"]
    return err


# ------------------------------------------------------------------------------- shapes
async def test_chat_non_streaming_shape(http):
    client, fake = http
    resp = await client.post("/v1/chat/completions", json=_chat(n=2, logprobs=True, top_logprobs=2, seed=7))
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and body["system_fingerprint"].startswith("fp_") and body["created"] > 0
    assert [c["index"] for c in body["choices"]] == [0, 1]
    c1 = body["choices"][1]
    assert c1["message"]["role"] == "assistant" and c1["message"]["content"] == "c1w0 c1w1 c1w2 "
    assert c1["finish_reason"] == "length"
    lp = c1["logprobs"]["content"]
    assert [t["token"] for t in lp] == ["c1w0 ", "c1w1 ", "c1w2 "] and len(lp[0]["top_logprobs"]) == 2
    assert lp[0]["bytes"] == list(b"c1w0 ")
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert fake.requests[-1].sampling.seed == 7


async def test_chat_streaming_events(http):
    client, _ = http
    resp = await client.post("/v1/chat/completions",
                             json=_chat(n=2, stream=True, stream_options={"include_usage": True}))
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = await _sse(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in m["delta"] for m in mine[1:])
        assert "".join(m["delta"].get("content", "") for m in mine) == f"c{index}w0 c{index}w1 c{index}w2 "
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]


async def test_completions_multi_prompt_echo_and_logprobs(http):
    client, _ = http
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "cd"], "n": 2,
                                                      "max_tokens": 2, "echo": True})
    body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [c["text"] for c in body["choices"]] == ["abc0w0 c0w1 ", "abc1w0 c1w1 ", "cdc0w0 c0w1 ", "cdc1w0 c1w1 "]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 8
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2,
                                                      "logprobs": 1})
    lp = (await resp.json())["choices"][0]["logprobs"]
    assert lp["tokens"] == ["c0w0 ", "c0w1 "] and lp["token_logprobs"] == [-0.25, -0.25]
    assert lp["top_logprobs"] == [{"alt0": -0.25}, {"alt0": -0.25}] and lp["text_offset"] == [0, 5]


async def test_completions_streaming_with_token_prompt_echo(http):
    client, _ = http
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[7, 8]], "max_tokens": 2,
                                                      "echo": True, "stream": True})
    events = await _sse(resp)
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "<7><8>c0w0 c0w1 " and events[-2]["choices"][0]["finish_reason"] == "length"


async def test_models_list_and_retrieve(http):
    client, _ = http
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"
    assert (await (await client.get(f"/v1/models/{MODEL}")).json())["id"] == MODEL
    await _error(await client.get("/v1/models/nope"), 404, "model", "model_not_found")


# ------------------------------------------------------------------------------- errors
async def test_error_statuses(http):
    client, _ = http
    await _error(await client.post("/v1/chat/completions", data=b"{oops", headers=JSON), 400)
    await _error(await client.post("/v1/chat/completions", json=_chat(top_p="x")), 400, "top_p")
    await _error(await client.post("/v1/chat/completions", json=_chat(temperature=3.0)), 400, "temperature")
    await _error(await client.post("/v1/chat/completions", json=_chat(model="gpt-9")), 404, "model",
                 "model_not_found")
    await _error(await client.get("/v1/nowhere"), 404, None, "not_found")
    resp = await client.get("/v1/chat/completions")
    await _error(resp, 405, None, "method_not_allowed")
    await _error(await client.post("/v1/chat/completions", data=b"x" * 5000, headers=JSON), 413, None,
                 "request_too_large")
    await _error(await client.post("/v1/chat/completions", json=_chat(tools=[{"type": "function"}])), 400, "tools[0].function")


async def test_engine_status_codes_become_http(http):
    client, _ = http
    msg = [{"role": "user", "content": "context-too-long"}]
    for stream in (False, True):
        await _error(await client.post("/v1/chat/completions", json=_chat(messages=msg, stream=stream)), 400,
                     "prompt", "context_length_exceeded")
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "queue-full", "stream": True})
    await _error(resp, 429, None, "queue_full")
    assert resp.headers["Retry-After"] == "1"


async def test_error_mid_stream_is_an_sse_event(http):
    client, _ = http
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "fail-midway", "stream": True})
    events = await _sse(resp)
    assert events[0]["choices"][0]["text"] == "c0w0 "
    assert events[-1]["error"]["code"] == "internal_error" and "[DONE]" not in events


async def test_embeddings_unsupported_model(http):
    client, fake = http
    await _error(await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 400, "model",
                 "model_not_supported")
    fake.capabilities = ["embeddings"]          # capability claimed, the RPC still UNIMPLEMENTED
    client.app[STATE_KEY].link.engines[0].link._models = None  # the model list is cached for 5 s
    await _error(await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 400, "model",
                 "model_not_supported")
    await _error(await client.post("/v1/embeddings", json={"model": MODEL, "input": 5}), 400, "input")


async def test_engine_down_is_503():
    client = await _client(1)        # nothing listens on port 1
    try:
        await _error(await client.post("/v1/chat/completions", json=_chat()), 503, None, "engine_unavailable")
        assert (await client.get("/ready")).status == 503
        assert (await client.get("/health")).status == 200
        assert "sluice_engine_up 0.0" in await (await client.get("/metrics")).text()
    finally:
        await client.close()


async def test_unhandled_fault_is_500_without_trace(http, monkeypatch):
    client, _ = http

    async def boom(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(client.app[STATE_KEY].link, "list_models", boom)
    err = await _error(await client.get("/v1/models"), 500, None, "internal_error")
    assert "secret" not in err["message"]


# --------------------------------------------------------------------------- disconnect
@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_engine_call(http, stream):
    client, fake = http
    body = _chat(stream=stream, messages=[{"role": "user", "content": "slow"}])
    task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    if stream:
        resp = await task
        await resp.content.readline()           # first event arrived: the request is running
        resp.close()
    else:
        for _ in range(200):
            if fake.active:
                break
            await asyncio.sleep(0.01)
        assert fake.active
        task.cancel()
    for _ in range(200):
        if not fake.active and fake.aborted:
            break
        await asyncio.sleep(0.01)
    assert not fake.active and fake.cancelled, "the engine call outlived the client"
    assert fake.aborted == fake.cancelled        # and an Abort was sent for it


# ------------------------------------------------------------------------- auth / CORS
async def test_auth_on_every_route(fake_engine):  # noqa: F811
    _, port = fake_engine
    client = await _client(port, auth=AuthPolicy(keys=("other", KEY)))
    try:
        for ep in ENDPOINTS:
            path = ep.path.replace("{model}", MODEL)
            public = ep.public     # probes and the documentation (auth.PUBLIC_PATHS lists the same)
            for headers, ok in (({}, public), ({"Authorization": "Bearer nope"}, public),
                                ({"Authorization": f"Bearer {KEY}"}, True)):
                resp = await client.request(ep.method, path, headers=headers, json={})
                assert (resp.status != 401) == ok, (ep.method, path, headers, resp.status)
                if resp.status == 401:
                    body = await resp.json()
                    if path.startswith("/models/"):   # the AFS dialect has its own error body
                        assert body["status_code"] == 401
                    else:
                        assert body["error"]["code"] == "invalid_api_key"
        ok = await client.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status == 200
    finally:
        await client.close()


def test_the_public_paths_are_the_endpoints_marked_public() -> None:
    """auth.py spells its public paths (it loads without the OpenAPI models, for the supervisor);
    the endpoint table marks them too, and the two must agree."""
    from sluice.http_facade import auth, openapi

    assert auth.PUBLIC_PATHS == openapi.PUBLIC_PATHS


async def test_cors_preflight_and_headers(fake_engine):  # noqa: F811
    _, port = fake_engine
    client = await _client(port, auth=AuthPolicy(keys=(KEY,)),
                           cors=CorsPolicy(allow_credentials=True, allowed_origins=("http://ui.example",)))
    try:
        pre = await client.options("/v1/chat/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status == 204                  # no key needed for the preflight
        assert pre.headers["Access-Control-Allow-Origin"] == "http://ui.example"
        assert pre.headers["Access-Control-Allow-Credentials"] == "true"
        assert "authorization" in pre.headers["Access-Control-Allow-Headers"]
        bad = await client.options("/v1/models", headers={"Origin": "http://evil.example",
                                                          "Access-Control-Request-Method": "GET"})
        assert bad.status == 403 and "Access-Control-Allow-Origin" not in bad.headers
        resp = await client.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == "http://ui.example"
        assert resp.headers["Access-Control-Expose-Headers"] == "X-Request-Id" and resp.headers["X-Request-Id"]
        assert "Access-Control-Expose-Headers" not in pre.headers    # a preflight's answer is not read
    finally:
        await client.close()


# ------------------------------------------------------------------- metrics / docs / misc
async def test_metrics_docs_openapi_ready_and_trace(http):
    client, _ = http
    await client.post("/v1/chat/completions", json=_chat())
    text = await (await client.get("/metrics")).text()
    for name in ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_kv_cache_usage_ratio",
                 "sluice_prefix_cache_hit_rate 0.5",
                 'sluice_time_to_first_token_seconds_count{model="fake-model"} 1.0',
                 'sluice_inter_token_latency_seconds_count{model="fake-model"} 2.0',
                 'sluice_e2e_request_latency_seconds_count{model="fake-model"} 1.0',
                 'sluice_prompt_tokens_total{model="fake-model"} 1.0',
                 'sluice_generation_tokens_total{model="fake-model"} 3.0'):
        assert name in text, name
    docs = await (await client.get("/docs")).text()
    assert all(ep.path in docs for ep in ENDPOINTS)
    spec = await (await client.get("/openapi.json")).json()
    assert "/v1/chat/completions" in spec["paths"] and spec["openapi"].startswith("3.")
    assert (await (await client.get("/ready")).json())["status"] == "ready"
    trace = await (await client.post("/debug/dump_event_trace", json={})).json()
    assert trace["data"][-1]["completion_tokens"] == 3 and trace["data"][-1]["outcome"] == "ok"


def test_app_builds_without_an_event_loop():
    app = build_app(FacadeConfig(engine_addr="127.0.0.1:9"))
    assert isinstance(app, web.Application)
    with pytest.raises(ValueError, match="engine_addr"):
        FacadeConfig(engine_addr="nohost")


def test_a_choice_failed_by_its_own_input_is_a_400_and_any_other_failure_a_500():
    from sluice.engine.rpc import engine_pb2 as pb
    from sluice.http_facade import afs_generation, shapes
    from sluice.http_facade.errors import ApiError

    dead_end = pb.ChoiceFinal(finish_reason=pb.FINISH_REASON_ERROR,
                              error="ValueError: grammar: no token of the model's vocabulary can continue")
    fault = pb.ChoiceFinal(finish_reason=pb.FINISH_REASON_ERROR, error="RuntimeError: injected fault")
    for finish in (shapes.finish_reason, afs_generation.finish_reason):
        with pytest.raises(ApiError) as info:
            finish(dead_end)
        assert info.value.status == 400 and info.value.message.startswith("grammar: no token")
        with pytest.raises(ApiError) as info:
            finish(fault)
        assert info.value.status == 500 and "RuntimeError: injected fault" in info.value.message
