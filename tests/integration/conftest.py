"""Real engine processes for the gRPC integration tests.

``engine_server`` (session): ``python -m sluice.engine.cli engine smollm2 --port <free port>`` with room
for 16 concurrent sequences and the debug fault-injection switch on (prompts containing
``<<sluice-fault>>`` fail inside the engine step; off by default, see ``engine.envs``).
``launch_engine`` starts further processes (the small engine the shutdown tests SIGTERM), on the
tiny random-weight SmolLM2 (``tiny_smollm2``, tests/conftest.py) where only the plumbing is tested.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.engine.client import EngineClient, EngineRpcError

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
# Shared with test_grpc_generate's offline reference, so that both engines are configured alike.
MAIN_OVERRIDES = "max_num_sequence=16;max_waiting=64;max_total_seq_length=8192;prefill_chunk_size=2048"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def engine_threads(model: str | Path) -> str:
    """OMP_NUM_THREADS for an engine process: one for the tiny model, whose matmuls are too small
    to split (on this 2-core machine two threads made its steps ~8x slower whenever another
    process ran); the real model's default otherwise."""
    return "1" if str(model) != "smollm2" else os.environ.get("OMP_NUM_THREADS", "2")


def launch_engine(log_path: Path, *args: str, model: str | Path = "smollm2",
                  fault_injection: bool = False) -> EngineProcess:
    """Start an engine process on ``model`` (a short name or a path, e.g. the ``tiny_smollm2``
    fixture's); returns at once (it is still loading)."""
    port = free_port()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": engine_threads(model),
           "SLUICE_DEBUG_FAULT_INJECTION": "1" if fault_injection else "0"}
    cmd = [sys.executable, "-m", "sluice.engine.cli", "engine", str(model), "--device", "cpu", "--port", str(port),
           *args]
    log = open(log_path, "wb")   # noqa: SIM115 - the child owns it until it exits
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return EngineProcess(proc, port, log_path)


def wait_serving(engine: EngineProcess, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with EngineClient(engine.target) as client:
        while time.monotonic() < deadline:
            if engine.proc.poll() is not None:
                pytest.fail(f"engine exited with {engine.proc.returncode} while loading:\n{engine.log_tail()}")
            try:
                if client.health(timeout=2.0) == "SERVING":
                    return
            except EngineRpcError:
                pass
            time.sleep(0.1)
    engine.stop()
    pytest.fail(f"engine not SERVING after {timeout}s:\n{engine.log_tail()}")


# The session engine takes ~12 s to come up (imports, SmolLM2, MiniLM); collecting the whole suite
# takes about as long. So it is started as soon as collection meets a test that needs it, and
# loads while the rest is collected; if deselection (-k, -m) leaves no such test it is stopped.
_early: dict[str, EngineProcess] = {}


def _launch_session_engine() -> EngineProcess:
    log = Path(tempfile.mkdtemp(prefix="sluice-session-engine-")) / "engine.log"
    return launch_engine(log, "--mode", "local", "--overrides", MAIN_OVERRIDES, fault_injection=True)


def _stop_session_engine(engine: EngineProcess) -> None:
    """Stop it and remove its log's folder (a failing test has already shown the log's tail)."""
    try:
        engine.stop()
    finally:
        shutil.rmtree(engine.log_path.parent, ignore_errors=True)


def pytest_itemcollected(item) -> None:
    if ("engine_server" in getattr(item, "fixturenames", ()) and not _early
            and not item.config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ):
        _early["engine"] = _launch_session_engine()


@pytest.hookimpl(trylast=True)   # after -k / -m deselected what they deselect
def pytest_collection_modifyitems(items) -> None:
    if _early and not any("engine_server" in getattr(i, "fixturenames", ()) for i in items):
        _stop_session_engine(_early.pop("engine"))


def pytest_sessionfinish() -> None:
    if _early:   # started, never used (an interrupted or failed collection)
        _stop_session_engine(_early.pop("engine"))


@pytest.fixture(scope="session")
def engine_server() -> EngineProcess:
    engine = _early.pop("engine", None) or _launch_session_engine()
    try:
        wait_serving(engine)
        yield engine
    finally:
        _stop_session_engine(engine)


@pytest.fixture
def client(engine_server: EngineProcess) -> EngineClient:
    with EngineClient(engine_server.target, timeout=120.0) as c:
        yield c


def wait_for_idle(client: EngineClient, timeout: float = 30.0):
    """Poll GetLoad until nothing runs, waits or holds a KV block; returns the last reading."""
    deadline = time.monotonic() + timeout
    load = client.load()
    while time.monotonic() < deadline:
        load = client.load()
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_blocks_used == 0 and load.num_in_flight == 0:
            return load
        time.sleep(0.05)
    return load
