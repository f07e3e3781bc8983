"""Careless and hostile clients against one ``sluice serve`` on the tiny random-weight model
(issue #16), with an API key and the engine's gRPC port open: disconnects mid-stream and before
the answer, gRPC cancel and deadline, 30 client timeouts then a canary, a full queue (accepted +
rejected == sent, 429 with Retry-After), context overflow (400), KV oversubscription (greedy
outputs byte-identical to the same requests run one by one), API keys on every route and CORS,
and the request caps over gRPC (INVALID_ARGUMENT naming the parameter). After each case the
engine is back to its idle baseline: nothing running, waiting or in flight, no KV block in use.

The same cases against the real default model live in tests/integration (test_grpc_cancel,
test_facade_http's disconnects and auth, test_facade_serve's 429); these run in seconds and read
the KV gauges through ``/metrics`` as an operator would.
"""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import grpc
import pytest
import requests

from sluice.engine.client import EngineClient, EngineRpcError
from sluice.http_facade.openapi import ENDPOINTS
from tests.reliability.serve import Serve, sse, wait_idle
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
KEY = "reliability-key"
POOL_TOKENS = 1024            # the KV pool, and the context window
MAX_SEQS, MAX_WAITING = 4, 4
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Serve(write_tiny_folder(tmp / "tiny"), tmp / "serve.log", api_key=KEY,
              overrides=f"max_total_seq_length={POOL_TOKENS};max_num_sequence={MAX_SEQS};max_waiting={MAX_WAITING}")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture
def idle(serve):
    """Every case starts and ends with the engine idle."""
    baseline = wait_idle(serve)
    yield baseline
    assert wait_idle(serve)["sluice_kv_cache_blocks_total"] == baseline["sluice_kv_cache_blocks_total"]


def _completion(serve: Serve, n_prompt: int, **kw) -> dict:
    return {"model": serve.model, "prompt": prompt(n_prompt), **LONG, **kw}


def _busy(serve: Serve, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = serve.load()
        if load["sluice_num_requests_running"] >= 1 and load["sluice_kv_cache_blocks_used"] > 0:
            return load
        time.sleep(0.02)
    raise AssertionError(f"the engine never ran the request: {serve.load()}")


# ---------------------------------------------------------------------------- disconnects
def test_disconnect_mid_stream_frees_the_kv(serve, idle):
    with serve.post("/v1/completions", json=_completion(serve, 8, stream=True), stream=True) as resp:
        chunks = resp.iter_content(chunk_size=None)
        assert next(chunks).startswith(b"data: ")
        _busy(serve)
    # leaving the block closed the connection; the idle fixture asserts the KV is back


def test_disconnect_before_a_non_streaming_answer_frees_the_kv(serve, idle):
    body = json.dumps(_completion(serve, 8)).encode()
    with socket.create_connection(("127.0.0.1", serve.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        _busy(serve)


# ---------------------------------------------------------------------------------- gRPC
def test_grpc_cancel_mid_stream_frees_the_kv(serve, idle):
    with EngineClient(serve.engine_target, timeout=60) as client:
        stream = client.generate(prompt(8), **LONG)
        assert not next(stream).finished
        assert client.load().kv_blocks_used > 0
        stream.cancel()
        assert list(stream) == []


def test_grpc_deadline_aborts_the_request(serve, idle):
    with EngineClient(serve.engine_target) as client:
        # 1000 tokens take seconds on this machine; the deadline is far shorter.
        with pytest.raises(EngineRpcError) as info:
            for _ in client.generate(prompt(8), timeout=0.3, **LONG):
                pass
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


# ------------------------------------------------------------------ timeouts, queue, length
def test_30_client_timeouts_then_a_canary_succeeds(serve, idle):
    def impatient(_: int) -> str:
        try:
            r = serve.post("/v1/completions", json=_completion(serve, 8), timeout=(5, 0.2))
        except requests.ReadTimeout:
            return "timeout"
        return f"answered {r.status_code} {r.text[:100]}"

    # In waves no larger than the waiting queue (a burst is queued before the scheduler admits
    # any of it), so that each request times out rather than being refused with a 429.
    outcomes: list[str] = []
    while len(outcomes) < 30:
        with ThreadPoolExecutor(MAX_WAITING) as pool:
            outcomes += pool.map(impatient, range(min(MAX_WAITING, 30 - len(outcomes))))
        wait_idle(serve)
    assert outcomes == ["timeout"] * 30, (len(outcomes), [o for o in outcomes if o != "timeout"])
    canary = serve.post("/v1/completions", json=_completion(serve, 4, max_tokens=5))
    assert canary.status_code == 200 and canary.json()["choices"][0]["finish_reason"] == "length"


def test_a_full_queue_refuses_with_429_and_loses_nothing(serve, idle):
    sent = 30
    with ThreadPoolExecutor(sent) as pool:
        answers = list(pool.map(lambda _: serve.post("/v1/completions", json=_completion(serve, 8, max_tokens=300)),
                                range(sent)))
    accepted = [r for r in answers if r.status_code == 200]
    rejected = [r for r in answers if r.status_code == 429]
    assert len(accepted) + len(rejected) == sent, sorted(r.status_code for r in answers)
    assert len(accepted) >= MAX_SEQS and rejected
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in accepted)
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"


def test_context_overflow_is_a_400(serve, idle):
    r = serve.post("/v1/completions", json=_completion(serve, POOL_TOKENS + 10, max_tokens=5))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "Traceback" not in r.text


def test_kv_oversubscription_keeps_greedy_outputs_byte_identical(serve, idle):
    """Four requests whose prompts + generations need more KV than the pool holds: the scheduler
    preempts and recomputes, and every output is exactly what the request gives alone."""
    bodies = [_completion(serve, 20 + 7 * i, max_tokens=300) for i in range(MAX_SEQS)]
    total = sum(20 + 7 * i + 300 for i in range(MAX_SEQS))
    assert total > idle["sluice_kv_cache_blocks_total"] * 16          # oversubscribed
    alone = [serve.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    with ThreadPoolExecutor(MAX_SEQS) as pool:
        together = list(pool.map(lambda b: serve.post("/v1/completions", json=b).json()["choices"][0]["text"],
                                 bodies))
    assert [t.encode() for t in together] == [t.encode() for t in alone]
    assert all(len(t.split()) == 300 for t in alone)


# -------------------------------------------------------------------------------- auth, CORS
_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "w1 w2", "max_tokens": 2},
    "/models/conversation": {"messages": [{"role": "human", "content": "w1 w2"}],
                             "parameters": {"max_new_tokens": 2}},
    "/models/generate": {"inputs": "w1 w2", "parameters": {"max_new_tokens": 2}},
}


def _stored_response(serve) -> str:
    """A stored response's id, for /v1/responses/{response_id} (DELETE removes it: one each)."""
    made = serve.post("/v1/responses", json={"model": serve.model, "input": "w1 w2", "max_output_tokens": 2})
    assert made.status_code == 200, made.text[:200]
    return made.json()["id"]


def test_api_keys_on_every_route_and_cors_preflight(serve, idle):
    for ep in ENDPOINTS:
        path = ep.path.replace("{model}", quote(serve.model, safe=""))
        if "{response_id}" in path:
            path = path.replace("{response_id}", _stored_response(serve))
        body = {"model": serve.model, **_BODIES.get(ep.path, {})}
        call = {"GET": requests.get, "DELETE": requests.delete}.get(ep.method, requests.post)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-KEY": "wrong"}):
            r = call(serve.url + path, headers=headers, json=body, timeout=30)
            if ep.public:
                assert r.status_code == 200, (ep.path, r.status_code)
            else:
                assert r.status_code == 401, (ep.path, headers, r.status_code)
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-API-KEY": KEY}):
            r = call(serve.url + path, headers=headers, json=body, timeout=30)
            if "{response_id}" in ep.path and ep.method == "DELETE":
                path = path.rsplit("/", 1)[0] + "/" + _stored_response(serve)   # the next key deletes anew
            if ep.method in ("GET", "DELETE") or ep.path in _BODIES:
                assert r.status_code == 200, (ep.path, r.status_code, r.text[:200])
            else:   # no embedding model, no FIM tokens, tracing off: refused, but not for the key
                assert r.status_code not in (401, 500), (ep.path, r.status_code)
        if ep.method == "POST":
            pre = requests.options(serve.url + path, timeout=10, headers={
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,x-api-key"})
            assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == "*", ep.path
    plain = serve.post("/v1/completions", json={"model": serve.model, **_BODIES["/v1/completions"]},
                       headers={"Origin": "http://app.example"})
    assert plain.status_code == 200 and plain.headers["Access-Control-Allow-Origin"] == "*"


# ------------------------------------------------------------------------------- gRPC caps
@pytest.mark.parametrize(("sampling", "param"), [
    ({"n": 129}, "n"),
    ({"stop": ["w1"] * 17}, "stop"),
    ({"stop": ["w" * 257]}, "stop"),
    ({"stop_token_ids": [1] * 17}, "stop_token_ids"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_grpc_caps_are_invalid_argument_naming_the_parameter(serve, idle, sampling, param):
    with EngineClient(serve.engine_target, timeout=30) as client:
        with pytest.raises(EngineRpcError) as info:
            client.generate(prompt(4), max_tokens=2, **sampling).collect()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.removeprefix("sampling.").startswith(param + ":"), info.value.message


def test_grpc_prompt_over_the_byte_cap_is_invalid_argument(serve, idle):
    with EngineClient(serve.engine_target, timeout=30) as client:
        with pytest.raises(EngineRpcError) as info:
            client.generate("w1 " * ((1 << 20) // 3 + 10), max_tokens=2).collect()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in info.value.message
