"""A real ``sluice serve`` (engine process + facade process, supervised) for the reliability
suite, and the small client helpers its modules share: SSE parsing, ``/metrics`` readings and
waiting for the engine to be idle (nothing running, waiting or in flight, no KV block in use).
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

import requests

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 3.0
# The gauges that say "the engine holds nothing": all must read 0 once every request is over.
IDLE_GAUGES = ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_num_requests_in_flight",
               "sluice_kv_cache_blocks_used")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``python -m sluice.engine.cli serve FOLDER`` on free ports; ``api_key`` (if any) is sent by
    ``get``/``post`` and required by the server on every non-public route."""

    def __init__(self, folder: Path, log: Path, overrides: str = "max_total_seq_length=256;max_num_sequence=4",
                 api_key: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port, self.engine_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_target = f"127.0.0.1:{self.engine_port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SLUICE_DEBUG_INVARIANTS": "1"}
        keys = ["--api-key", api_key] if api_key else []
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.engine.cli", "serve", str(folder), "--device", "cpu",
                 "--port", str(self.port), "--engine-port", str(self.engine_port), "--embedding-model", "none",
                 "--grace", str(GRACE_S), "--overrides", overrides, *keys, *extra],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._model: str | None = None

    def wait_ready(self, timeout: float = 180) -> Serve:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if requests.get(self.url + "/ready", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError("serve not ready:\n" + self.log.read_text()[-3000:])

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.get("/v1/models").json()["data"][0]["id"]
        return self._model

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                            timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, **kw) -> requests.Response:
        return requests.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})},
                             timeout=kw.pop("timeout", 60), **kw)

    def load(self) -> dict[str, float]:
        """The unlabelled gauges of ``/metrics`` (the engine's GetLoad, read at scrape time)."""
        text = self.get("/metrics", timeout=5).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and len(line.split()) == 2}


def sse(resp: requests.Response) -> list:
    """The ``data:`` events of a streamed answer: parsed JSON, or the string ``[DONE]``."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(serve: Serve, timeout: float = 20) -> dict[str, float]:
    """Polls ``/metrics`` until every idle gauge reads 0; asserts it does within ``timeout`` (a
    request that leaked a KV block, or a stream the engine still tracks, fails here)."""
    deadline = time.monotonic() + timeout
    while True:
        load = serve.load()
        missing = [g for g in IDLE_GAUGES if g not in load]
        assert not missing, f"/metrics lacks {missing}"
        if all(load[g] == 0 for g in IDLE_GAUGES) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(load[g] == 0 for g in IDLE_GAUGES), {g: load[g] for g in IDLE_GAUGES}
    assert load["sluice_engine_up"] == 1 and load["sluice_kv_cache_blocks_total"] > 0
    return load
