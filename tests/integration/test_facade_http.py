"""The facade in front of a real engine process (the session engine of conftest.py, smollm2):
the seed documents' Python examples run as written (only host/port/model changed), the 503 of a
dead engine, auth on every route, a CORS preflight, the body limit, and that a client who leaves
mid-stream or mid-request returns the engine to idle (GetLoad: nothing running or waiting, no
KV block in use). ``facade`` here is a real ``python -m sluice.http_facade.cli facade`` process."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from sluice.engine.client import EngineClient
from tests.integration.conftest import REPO, free_port, wait_for_idle

pytestmark = pytest.mark.slow

KEY = "sk-facade-test"
MODEL = "smollm2"
BODY_LIMIT = 65536


@dataclass
class FacadeProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def launch_facade(engine_target: str, log_path: Path, *args: str, keys: str = KEY) -> FacadeProcess:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLUICE_API_KEYS": keys}
    # Requests without max_tokens (the seed examples) get 48: this 2-core box is too slow to let a
    # 135M model at temperature 1 run to its 8k context window.
    cmd = [sys.executable, "-m", "sluice.http_facade.cli", "facade", "--engine", engine_target, "--port", str(port),
           "--max-body-bytes", str(BODY_LIMIT), "--default-max-tokens", "48", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    facade = FacadeProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"facade exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if requests.get(facade.url + "/health", timeout=1).status_code == 200:
                return facade
        except requests.ConnectionError:
            time.sleep(0.1)
    facade.stop()
    pytest.fail("facade did not answer /health within 30 s")


@pytest.fixture(scope="session")
def facade(engine_server, tmp_path_factory) -> FacadeProcess:
    f = launch_facade(engine_server.target, tmp_path_factory.mktemp("facade") / "facade.log")
    yield f
    assert f.stop() == 0


@pytest.fixture
def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _assert_idle(engine_server) -> None:
    with EngineClient(engine_server.target) as client:
        load = wait_for_idle(client, timeout=15)
    assert (load.num_running, load.num_waiting, load.kv_blocks_used, load.num_in_flight) == (0, 0, 0, 0), load


# --------------------------------------------------------------------- the seed examples
def test_mlc_examples_run_as_written(facade, monkeypatch, capsys):
    """mlc-llm-rest-api.rst: the non-streaming and the streaming requests examples and /v1/models.
    Changed: host/port, model; and the API key header our facade was started with."""
    base = facade.url
    headers = {"accept": "application/json", "Authorization": f"Bearer {KEY}"}
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a haiku about apples."}],
        "stream": False,
        "max_tokens": 300,
    }
    r = requests.post(f"{base}/v1/chat/completions", json=payload, headers=headers)
    choices = r.json()["choices"]
    for choice in choices:
        print(f"{choice['message']['content']}\n")
    assert r.status_code == 200 and choices[0]["message"]["content"]

    payload = {"model": MODEL, "messages": [{"role": "user", "content": "Write a haiku"}], "stream": True}
    pieces = []
    with requests.post(f"{base}/v1/chat/completions", json=payload, stream=True, headers=headers) as r:
        for chunk in r.iter_content(chunk_size=None):
            chunk = chunk.decode("utf-8")
            if "[DONE]" in chunk[6:]:
                break
            response = json.loads(chunk[6:])
            content = response["choices"][0]["delta"].get("content", "")
            print(content, end="", flush=True)
            pieces.append(content)
    print("\n")
    assert "".join(pieces).strip()

    response = requests.get(f"{base}/v1/models", headers=headers)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL


def test_litserve_requests_examples(facade):
    """litserve-openai-spec.txt: the plain `requests` clients, non-streaming and iter_lines streaming."""
    server_url = f"{facade.url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    request_data = {"model": MODEL, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                 {"role": "user", "content": "How are you?"}]}
    response = requests.post(server_url, json=request_data, headers=headers)
    print(response.json())
    assert response.json()["choices"][0]["message"]["role"] == "assistant"
    request_data = {"model": MODEL, "stream": True,
                    "messages": [{"role": "user", "content": "How can I help you today?"}]}
    response = requests.post(server_url, json=request_data, stream=True, headers=headers)
    lines = [chunk.decode("utf-8") for chunk in response.iter_lines() if chunk]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_tool_call_history_reaches_the_engine(facade, engine_server, auth):
    """An assistant turn's tool_calls and the tool's answer travel to the engine as typed messages
    (new ``tools`` are still refused with a 400): the prompt the engine renders is the one its
    Tokenize renders for the same conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]
    r = requests.post(f"{facade.url}/v1/chat/completions", headers=auth,
                      json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    with EngineClient(engine_server.target, timeout=60) as client:
        rendered = client.tokenize(messages=messages)
    assert r.json()["usage"]["prompt_tokens"] == len(rendered.token_ids)


# ---------------------------------------------------------------------------- disconnect
def test_disconnect_mid_stream_returns_the_engine_to_idle(facade, engine_server, auth):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything about rivers."}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with requests.post(f"{facade.url}/v1/chat/completions", json=body, headers=auth, stream=True) as r:
        events = r.iter_content(chunk_size=None)
        for _ in range(3):
            assert next(events).startswith(b"data: ")
        with EngineClient(engine_server.target) as client:
            assert client.load().num_running == 1
    _assert_idle(engine_server)


def test_disconnect_before_a_non_streaming_answer_returns_the_engine_to_idle(facade, engine_server, auth):
    body = json.dumps({"model": MODEL, "prompt": "Rivers are", "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = facade.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        with EngineClient(engine_server.target) as client:
            deadline = time.monotonic() + 30
            while client.load().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.load().num_running == 1
    _assert_idle(engine_server)


# ------------------------------------------------------------------------ errors / auth
def test_auth_cors_and_body_limit(facade, auth):
    routes = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("GET", "/metrics"), ("POST", "/v1/responses"),
              ("POST", "/tokenize")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.request(method, facade.url + path, headers=headers, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
        assert requests.request(method, facade.url + path, headers=auth, json={}).status_code != 401
    # probes, and the documentation and chat page (a browser loads them before any key is typed)
    for path in ("/health", "/ready", "/docs", "/openapi.json", "/"):
        assert requests.get(facade.url + path).status_code == 200
    pre = requests.options(facade.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 204 and pre.headers["Access-Control-Allow-Origin"] == "*"
    big = requests.post(facade.url + "/v1/completions", headers={**auth, "Content-Type": "application/json"},
                        data=b"{" + b" " * BODY_LIMIT + b"}")
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    metrics = requests.get(facade.url + "/metrics", headers=auth).text
    assert "sluice_kv_cache_blocks_total" in metrics and "sluice_engine_up 1.0" in metrics


def test_dead_engine_is_503(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    f = launch_facade(dead, tmp_path / "facade.log", keys="")
    try:
        r = requests.post(f.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert requests.get(f.url + "/ready").status_code == 503
    finally:
        assert f.stop() == 0
