"""Oversized input does not stall other clients (issue #16: a 7 MB prompt was tokenized whole on
the engine's step thread and froze every stream for 3.8 s; 300k stop strings were accepted).

One ``sluice serve`` on the tiny model with a 64k-token context keeps a long greedy stream
running while hostile requests go in, one after another, over HTTP and gRPC: each is refused,
and the stream's longest gap between two events while they are processed stays under a
generous bound (2 s; its usual gap is milliseconds), so the test says "no stall", not "fast".
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from sluice.engine.client import EngineClient, EngineRpcError
from tests.reliability.serve import Serve, wait_idle
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
MAX_GAP_S = 2.0


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    s = Serve(write_tiny_folder(tmp / "long", context=65536), tmp / "serve.log",
              overrides="max_total_seq_length=65536;max_num_sequence=2")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


class _Stream(threading.Thread):
    """A long stream read in the background; ``arrivals`` are the monotonic times of its events."""

    def __init__(self, serve: Serve) -> None:
        super().__init__(daemon=True)
        self.serve, self.arrivals, self.stop = serve, [], threading.Event()

    def run(self) -> None:
        body = {"model": self.serve.model, "prompt": prompt(4), "max_tokens": 60000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with self.serve.post("/v1/completions", json=body, stream=True) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: "):
                    self.arrivals.append(time.monotonic())
                if self.stop.is_set():
                    return

    def max_gap(self, start: float, end: float) -> float:
        """The longest silence between ``start`` and the first event after ``end``."""
        seen = list(self.arrivals)
        after = next((t for t in seen if t > end), time.monotonic())
        points = [start, *(t for t in seen if start <= t <= end), after]
        return max(b - a for a, b in zip(points, points[1:]))


def _http(serve: Serve, body: dict) -> tuple[int, str]:
    r = serve.post("/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return r.status_code, r.json()["error"]["message"]


def _grpc(serve: Serve, text: str, **sampling) -> tuple[str, str]:
    with EngineClient(serve.engine_target, timeout=60) as client:
        try:
            client.generate(text, max_tokens=2, **sampling).collect()
        except EngineRpcError as err:
            return err.code.name, err.message
    return "OK", ""


def test_oversized_prompts_and_huge_stop_lists_do_not_stall_a_concurrent_stream(serve):
    wait_idle(serve)
    model = serve.model
    hostile = [
        ("7 MB text prompt (HTTP)", lambda: _http(serve, {"model": model, "prompt": "w1 " * ((7 << 20) // 3)}),
         (400, "prompt")),
        ("800 kB prompt, 200k tokens (HTTP)", lambda: _http(serve, {"model": model, "prompt": prompt(200_000)}),
         (400, "context")),
        ("300k stop strings (HTTP)", lambda: _http(serve, {"model": model, "prompt": "w1", "stop": ["w2"] * 300_000}),
         (400, "stop")),
        ("3 MB text prompt (gRPC)", lambda: _grpc(serve, "w1 " * (1 << 20)), ("INVALID_ARGUMENT", "prompt")),
        ("300k stop strings (gRPC)", lambda: _grpc(serve, "w1", stop=["w2"] * 300_000),
         ("INVALID_ARGUMENT", "stop")),
    ]
    stream = _Stream(serve)
    stream.start()
    deadline = time.monotonic() + 30
    while len(stream.arrivals) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stream.arrivals) >= 20, "the concurrent stream never got going"
    try:
        for name, send, (status, word) in hostile:
            t0 = time.monotonic()
            got_status, message = send()
            t1 = time.monotonic()
            assert got_status == status and word in message, (name, got_status, message[:200])
            time.sleep(0.2)       # the silence until the stream's next event counts too
            gap = stream.max_gap(t0, t1)
            assert gap < MAX_GAP_S, f"{name}: the concurrent stream went silent for {gap:.2f} s"
    finally:
        stream.stop.set()
        stream.join(30)
    wait_idle(serve)
