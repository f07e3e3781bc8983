"""``sluice serve`` (``python -m sluice.http_facade.cli serve``): it starts the engine and the facade,
answers, refuses with 429 + Retry-After when the engine's waiting queue (made tiny with
``--overrides``) is full, and exits 0 on SIGTERM leaving no child behind; when the engine dies the
command exits non-zero and the HTTP port is released instead of hanging; unsupported flags fail
at once with a clear message. The served model is the tiny random-weight SmolLM2
(tests/model_files.py): these tests are about processes and queues, not answers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import REPO, engine_threads, free_port

START_S = 240


@pytest.fixture(scope="module")
def model(tiny_smollm2) -> str:
    return str(tiny_smollm2)


def _serve(tmp_path: Path, model: str, *args: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": engine_threads(model)}
    cmd = [sys.executable, "-m", "sluice.http_facade.cli", "serve", model, "--device", "cpu", "--port", str(port),
           "--embedding-model", "none", *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sluice serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if "ready on" in log.read_text(errors="replace"):
            return proc, url, log
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"sluice serve not ready after {START_S}s:\n{log.read_text()[-3000:]}")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _chat(url: str, model: str, max_tokens: int) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Count to one hundred."}],
        "max_tokens": max_tokens, "ignore_eos": True})


def test_serve_answers_429_on_a_full_queue_and_exits_0_on_sigterm(tmp_path, model):
    proc, url, log = _serve(tmp_path, model, "--overrides", "max_num_sequence=1;max_waiting=1")
    children = _children(proc.pid)
    try:
        assert len(children) == 2
        assert _chat(url, model, 4).status_code == 200
        # 200 tokens keep a request running for half a second or more on the tiny model, so the six
        # sent together find one running, one waiting and no room.
        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(lambda _: _chat(url, model, 200), range(6)))
        codes = sorted(r.status_code for r in statuses)
        assert 200 in codes and 429 in codes, codes
        refused = next(r for r in statuses if r.status_code == 429)
        assert refused.headers["Retry-After"] and refused.json()["error"]["type"] == "rate_limit_error"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not any(_alive(c) for c in children)


def test_serve_exits_nonzero_when_the_engine_dies(tmp_path, model):
    proc, url, log = _serve(tmp_path, model)
    try:
        engine = next(c for c in _children(proc.pid)
                      if b"sluice.engine.cli" in Path(f"/proc/{c}/cmdline").read_bytes())
        os.kill(engine, signal.SIGKILL)
        assert proc.wait(60) != 0
        assert "engine exited" in log.read_text()
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_unsupported_flags_fail_at_once():
    for flag, words in ((["--speculative-mode", "eagle"], "--speculative-mode eagle needs EAGLE heads"),
                        (["--speculative-mode", "ngram", "--additional-models", "x"], "--additional-models"),
                        (["--allowed-origins", "nope"], "--allowed-origins")):
        r = subprocess.run([sys.executable, "-m", "sluice.http_facade.cli", "serve", "smollm2", *flag], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and words in r.stderr, r.stderr
