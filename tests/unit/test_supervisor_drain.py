"""``sluice serve``'s shutdown: SIGTERM reaches the facade and the engine at once, and each may
take the whole grace (``--grace`` + a margin) to drain. The facade used to be killed after a
fixed 10 s, cutting longer streams with no error event, and the engine heard of the shutdown
only after that. Stand-in children record when SIGTERM arrived and take 4 s to exit, under a
grace of 8 s: the old order (the engine told only once the facade had gone) shows as SIGTERMs 4 s
apart, and a kill before the grace as a non-zero exit. (They took 10.5 s, past the old fixed 10 s,
which cost the suite 6 s of waiting for what the order check already catches.)"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from sluice.http_facade.supervisor import EngineSpec, ServePlan, Supervisor

pytestmark = pytest.mark.timeout(60)

CHILD = """
import signal, sys, time
def on_term(signum, frame):
    open(sys.argv[1], "w").write(repr(time.time()))
    time.sleep(float(sys.argv[2]))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".up", "w").write("up")
while True:
    time.sleep(0.05)
"""


def _child(tmp_path, name: str, drain_s: float) -> subprocess.Popen:
    mark = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(mark), str(drain_s)])
    deadline = time.monotonic() + 20
    while not (tmp_path / f"{name}.up").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    return proc


def _supervisor(stop_s: float) -> Supervisor:
    return Supervisor(ServePlan((EngineSpec((), "127.0.0.1:1", {}, None, "engine"),), (), "http://127.0.0.1:1", {},
                                1.0, stop_s))


def test_both_children_drain_together_for_the_whole_grace(tmp_path):
    sup = _supervisor(stop_s=8.0)
    sup.facade = _child(tmp_path, "facade", 4.0)
    sup.engines[0] = _child(tmp_path, "engine", 4.0)
    t0 = time.monotonic()
    sup._stop_all()
    assert 4.0 <= time.monotonic() - t0 < 8.0
    assert (sup.facade.returncode, sup.engines[0].returncode) == (0, 0)     # neither was killed
    got = [float((tmp_path / n).read_text()) for n in ("facade", "engine")]
    assert abs(got[0] - got[1]) < 1.0                                   # SIGTERM at once


def test_a_child_still_running_after_the_grace_is_killed(tmp_path):
    sup = _supervisor(stop_s=1.0)
    sup.facade = _child(tmp_path, "facade", 60)
    sup.engines[0] = _child(tmp_path, "engine", 0)
    t0 = time.monotonic()
    sup._stop_all()
    assert time.monotonic() - t0 < 5
    assert sup.facade.returncode == -9 and sup.engines[0].returncode == 0


# ---- start-up: the engine says it is ready through a pipe (no gRPC client in the supervisor) ----
ENGINE = """
import os, sys, time
fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
if sys.argv[1] == "fail":
    os.close(fd)          # as the engine does when the model fails to load, then exits
    sys.exit(3)
time.sleep(1.5)
os.write(fd, b"ready\\n")
os.close(fd)
time.sleep(30)
"""


# The facade stand-in: answers /ready (200) for a few seconds, then exits; or exits at once; or
# sleeps without ever listening.
FACADE = """
import http.server, sys, threading, time
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.end_headers()
        up = "true" if sys.argv[3] == "up" else "false"
        self.wfile.write(('{"status": "ready", "engines": [{"engine": "127.0.0.1:1", "serving": %s}]}' % up).encode())
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(float(sys.argv[2]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_plan(mode: str, facade: str = "exit", ready_timeout_s: float = 20.0) -> ServePlan:
    port = _free_port()
    engine = EngineSpec((sys.executable, "-c", ENGINE, mode), "127.0.0.1:1", {}, None, "engine")
    facade_cmd = {"exit": (sys.executable, "-c", "pass"),
                  "sleep": (sys.executable, "-c", "import time; time.sleep(30)"),
                  "ready": (sys.executable, "-c", FACADE, str(port), "4", "up"),
                  "unseen": (sys.executable, "-c", FACADE, str(port), "30", "down")}[facade]
    return ServePlan((engine,), facade_cmd, f"http://127.0.0.1:{port}", {}, ready_timeout_s, 1.0)


def test_serve_is_ready_once_the_engine_wrote_ready_and_the_facade_answers(capsys):
    # The facade starts beside the loading engine and answers /ready at once; "ready" still
    # waits for the engine's pipe (1.5 s), then the facade's exit ends serve.
    sup = Supervisor(_start_plan("ok", facade="ready"))
    t0 = time.monotonic()
    assert sup.run() == 1                                   # the stand-in facade exits after 4 s
    assert time.monotonic() - t0 >= 1.5
    err = capsys.readouterr().err
    assert "sluice serve: ready on" in err and "the facade exited with code 0; stopping" in err
    assert err.index("ready on") < err.index("the facade exited")
    assert sup.engines[0].poll() is not None               # stopped with the facade


def test_a_facade_that_dies_while_the_engine_loads_ends_serve(capsys):
    sup = Supervisor(_start_plan("ok", facade="exit"))
    assert sup.run() == 1
    assert sup.engines[0].poll() is not None
    err = capsys.readouterr().err
    assert "the facade exited with code 0 while waiting for the engine to load" in err
    assert "ready on" not in err


def test_an_engine_that_fails_to_load_ends_serve_at_once(capsys):
    sup = Supervisor(_start_plan("fail", facade="sleep"))
    t0 = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - t0 < 10
    assert sup.facade.poll() is not None                    # started beside it, stopped with it
    assert "the engine exited with code 3 while waiting for the engine to load" in capsys.readouterr().err


def test_serve_waits_until_the_facade_sees_every_engine(capsys, monkeypatch):
    # /ready is 200 (some engine serves) but lists this one as not serving yet: not ready.
    import sluice.http_facade.supervisor as supervisor

    monkeypatch.setattr(supervisor, "_FACADE_START_S", 3.0)
    sup = Supervisor(_start_plan("ok", facade="unseen"))
    assert sup.run() == 1
    err = capsys.readouterr().err
    assert "timed out after 3s waiting for the facade to see the engines" in err and "ready on" not in err
