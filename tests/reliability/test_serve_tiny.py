"""``sluice serve`` for real (engine process + facade process, supervised) on the tiny
random-weight model, driven the way careless and hostile clients behave (issue #16). The KV pool
is 256 tokens, so a long generation outgrows it.

Covers: a generation that outgrows the pool ends with a terminal record and [DONE] (it used to
hang); n over the cap, hostile JSON and a text/plain body are 400 / 415 and leave the engine
idle; HTTP/1.0 streaming; SIGTERM drains: a stream in flight runs on for the grace, then gets an
error event, and serve exits 0; an engine killed mid-stream: the stream ends with an error event,
serve exits non-zero and the port is free. The other cases of the suite sit in the sibling
modules (one server each); ``_wait_idle`` used to read gauges /metrics does not have, and so
never waited: it now asserts the real ones (tests/reliability/serve.py).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import requests

from tests.reliability.serve import GRACE_S, Serve, sse, wait_idle
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Serve(write_tiny_folder(tmp / "tiny"), tmp / "serve.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_a_generation_that_outgrows_the_kv_pool_ends_with_a_terminal_record(serve):
    body = {"model": "tiny", "prompt": prompt(200), "max_tokens": 150, "ignore_eos": True, "stream": True,
            "temperature": 0}
    models = requests.get(serve.url + "/v1/models", timeout=5).json()["data"]
    body["model"] = models[0]["id"]
    with requests.post(serve.url + "/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        events = sse(resp)
    assert events[-1] == "[DONE]"
    finals = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert 0 < len(text.split()) < 150           # ended by the pool, not by max_tokens
    wait_idle(serve)


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
    wait_idle(serve)


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


def _engine_pid(serve_pid: int) -> int:
    children = Path(f"/proc/{serve_pid}/task/{serve_pid}/children").read_text().split()
    return next(int(c) for c in children
                if b"sluice.engine.cli\x00engine\x00" in Path(f"/proc/{c}/cmdline").read_bytes())


def test_engine_killed_mid_stream_ends_the_stream_with_an_error_and_serve_exits_nonzero(tmp_path):
    """SIGKILL the engine while a long stream is open: the stream gets an error event (not a
    silent cut, not [DONE]), ``serve`` exits non-zero, and the HTTP port is free again."""
    s = Serve(write_tiny_folder(tmp_path / "long", context=65536), tmp_path / "serve.log",
              overrides="max_total_seq_length=65536;max_num_sequence=2").wait_ready()
    try:
        body = {"model": s.model, "prompt": prompt(4), "max_tokens": 60000, "ignore_eos": True, "stream": True}
        with s.post("/v1/completions", json=body, stream=True) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith(b"data: "))
            assert json.loads(first[6:])["choices"]
            os.kill(_engine_pid(s.proc.pid), signal.SIGKILL)
            rest = [line[6:].decode() for line in lines if line.startswith(b"data: ")]
        assert rest and rest[-1] != "[DONE]"
        assert "error" in json.loads(rest[-1]), rest[-3:]
        assert s.proc.wait(60) != 0
        with pytest.raises(requests.ConnectionError):
            requests.get(s.url + "/health", timeout=2)
        with socket.socket() as sock:
            # SO_REUSEADDR, as a restarted server sets it: connections in TIME_WAIT do not count,
            # a socket still listening (a hung facade) would.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", s.port))
            sock.listen()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
