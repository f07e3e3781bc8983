"""``sluice serve --data-parallel 2``: two engine processes of the tiny random-weight model behind
one facade. Requests that share a long prompt prefix land on one engine and hit its prefix cache
(``cached_tokens``); distinct prompts spread over both; killing one engine mid-stream ends that
engine's streams with an error event while the other streams finish, ``/ready`` stays 200, new
requests are served, and the supervisor starts the dead engine again, which the facade takes
back (its per-engine gauge returns to 1)."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.integration.test_facade_serve import _children, _serve

SYSTEM = "You answer questions about tides, harbours and the boats that use them, briefly. " * 6


@pytest.fixture(scope="module")
def model(tiny_smollm2) -> str:
    return str(tiny_smollm2)


def _engines(pid: int) -> list[int]:
    return [c for c in _children(pid) if b"sluice.engine.cli" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _chat(url: str, model: str, question: str, system: str | None = SYSTEM, **kw) -> requests.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return requests.post(url + "/v1/chat/completions", timeout=120,
                         json={"model": model, "messages": messages, "max_tokens": 4, **kw})


def _gauges(url: str, name: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('engine="')[1].split('"')[0]] = float(value)
    return out


def _stream(url: str, model: str, i: int) -> list:
    events = []
    with requests.post(url + "/v1/chat/completions", timeout=120, stream=True, json={
            "model": model, "messages": [{"role": "user", "content": f"Story number {i}, please."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[6:].decode())
    return events


def test_two_replicas_prefix_routing_and_failover(tmp_path, model):
    proc, url, log = _serve(tmp_path, model, "--data-parallel", "2", "--overrides", "max_num_sequence=8")
    try:
        assert len(_engines(proc.pid)) == 2
        cached = [_chat(url, model, f"When is high tide on day {i}?").json()["usage"] for i in range(4)]
        assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in cached[1:]), cached
        routed = _gauges(url, "sluice_engine_routed_requests")
        assert sorted(routed.values()) == [0.0, 4.0], routed            # one engine took them all
        for i in range(4):
            assert _chat(url, model, f"distinct question {i}", system=None).status_code == 200
        routed = _gauges(url, "sluice_engine_routed_requests")
        assert sorted(routed.values()) == [2.0, 6.0], routed            # distinct prompts spread

        with ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(_stream, url, model, i) for i in range(4)]
            time.sleep(1.0)                                             # every stream is running
            victim = _engines(proc.pid)[0]
            os.kill(victim, signal.SIGKILL)
            results = [f.result(timeout=120) for f in futures]
        failed = [r for r in results if any('"error"' in e for e in r)]
        done = [r for r in results if r and r[-1] == "[DONE]" and not any('"error"' in e for e in r)]
        assert failed and done and len(failed) + len(done) == 4, [r[-2:] for r in results]
        assert requests.get(url + "/ready", timeout=10).status_code == 200
        for i in range(3):
            assert _chat(url, model, f"after the failure {i}", system=None).status_code == 200
        deadline = time.monotonic() + 120                               # restarted, then taken back
        while time.monotonic() < deadline:
            serving = _gauges(url, "sluice_engine_serving")
            if len(serving) == 2 and all(v == 1.0 for v in serving.values()):
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"the killed engine did not come back: {serving}\n{log.read_text()[-2000:]}")
        assert "starting the engine" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
