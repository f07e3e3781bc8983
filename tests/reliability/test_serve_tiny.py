"""``sluice serve`` for real (engine process + facade process, supervised) on the tiny
random-weight model, driven the way careless and hostile clients behave (issue #16). The KV pool
is 256 tokens, so a long generation outgrows it.

Covers: a generation that outgrows the pool ends with a terminal record and [DONE] (it used to
hang); n over the cap, hostile JSON and a text/plain body are 400 / 415 and leave the engine
idle; HTTP/1.0 streaming; SIGTERM drains: a stream in flight runs on for the grace, then gets an
error event, and serve exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
GRACE_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, folder: Path, log: Path, overrides: str = "max_total_seq_length=256;max_num_sequence=4") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SLUICE_DEBUG_INVARIANTS": "1"}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.engine.cli", "serve", str(folder), "--device", "cpu",
                 "--port", str(self.port), "--embedding-model", "none", "--grace", str(GRACE_S),
                 "--overrides", overrides],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if requests.get(self.url + "/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError("serve not ready:\n" + self.log.read_text()[-3000:])

    def load(self) -> dict:
        text = requests.get(self.url + "/metrics", timeout=5).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and len(line.split()) == 2}


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Serve(write_tiny_folder(tmp / "tiny"), tmp / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()


def _sse(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _wait_idle(serve: Serve, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = serve.load()
        if all(v == 0 for k, v in load.items() if k.startswith(("sluice_engine_requests_running",
                                                                   "sluice_engine_kv_blocks_used",
                                                                   "sluice_engine_in_flight"))):
            return load
        time.sleep(0.1)
    return serve.load()


def test_a_generation_that_outgrows_the_kv_pool_ends_with_a_terminal_record(serve):
    body = {"model": "tiny", "prompt": prompt(200), "max_tokens": 150, "ignore_eos": True, "stream": True,
            "temperature": 0}
    models = requests.get(serve.url + "/v1/models", timeout=5).json()["data"]
    body["model"] = models[0]["id"]
    with requests.post(serve.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert 0 < len(text.split()) < 150           # ended by the pool, not by max_tokens
    _wait_idle(serve)


@pytest.mark.parametrize(("data", "headers", "status"), [
    (json.dumps({"model": "m", "prompt": "w1", "n": 2_000_000}).encode(), {"Content-Type": "application/json"}, 400),
    (b"[" * 100_000 + b"]" * 100_000, {"Content-Type": "application/json"}, 400),
    (b'{"model": "m", "prompt": "a\\ud800"}', {"Content-Type": "application/json"}, 400),
    (b'{"model": "m", "prompt": ' + b"9" * 5000 + b"}", {"Content-Type": "application/json"}, 400),
    (json.dumps({"model": "m", "prompt": "w1"}).encode(), {"Content-Type": "text/plain"}, 415),
])
def test_hostile_requests_are_refused_and_leave_nothing(serve, data, headers, status):
    t0 = time.monotonic()
    resp = requests.post(serve.url + "/v1/completions", data=data, headers=headers, timeout=30)
    assert resp.status_code == status, resp.text[:300]
    assert time.monotonic() - t0 < 5 and "Traceback" not in resp.text
    _wait_idle(serve)


def test_http10_streaming(serve):
    model = requests.get(serve.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    data = json.dumps({"model": model, "prompt": prompt(5), "max_tokens": 4, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", serve.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
    assert b"Transfer-Encoding" not in head and body.endswith(b"data: [DONE]\n\n")


def test_sigterm_drains_then_ends_the_open_stream_with_an_error_event(tmp_path):
    """A generation far longer than the grace: it runs on during the grace, then its stream
    ends with an error event, and ``serve`` exits 0 soon after."""
    s = Serve(write_tiny_folder(tmp_path / "long", context=65536), tmp_path / "serve.log",
              overrides="max_total_seq_length=65536;max_num_sequence=2")
    try:
        s.wait_ready()
        model = requests.get(s.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt(4), "max_tokens": 60000, "ignore_eos": True, "stream": True}
        with requests.post(s.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            assert json.loads(first[6:])["choices"]
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            rest = [line[6:].decode() for line in lines if line.startswith(b"data: ")]
        ended = time.monotonic() - t0
        assert rest and rest[-1] != "[DONE]"
        last = json.loads(rest[-1])
        assert "error" in last, rest[-3:]
        assert len(rest) > 10 and GRACE_S - 0.5 <= ended < GRACE_S + 10, ended   # it ran on for the grace
        assert s.proc.wait(60) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
