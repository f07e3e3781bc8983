"""``sluice serve``: the engine and the facade as two child processes, supervised.

Start the engine (``python -m sluice.engine.cli engine MODEL --port <free port> --ready-fd N``),
wait for it to write "ready" to that pipe (it does once its gRPC health says SERVING), start the
facade (``python -m sluice.http_facade.cli facade --engine ...``), wait for its ``/health``, then
watch both:

* one child exits → the other is stopped and ``serve`` exits non-zero (never a hung port);
* SIGTERM / SIGINT → the facade stops taking requests, the engine drains, exit 0.

Children get their own session (terminal signals reach only the supervisor, which forwards
them in order) and, on Linux, a parent-death signal so that they do not outlive a killed
supervisor. API keys reach the facade through its environment, not its command line.
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from sluice.http_facade.auth import ENV_KEYS
from sluice.http_facade.cli import afs_config, facade_config
from sluice.http_facade.limits import ENGINE_KEYS, RequestLimits

log = logging.getLogger("sluice.serve")

_POLL_S = 0.2
_FACADE_START_S = 60.0


def python_module_cmd(module: str) -> tuple[str, ...]:
    """``python -m module`` for a child process. On Python >= 3.11 with ``-P``: the working
    directory is not put on ``sys.path``, so a user's own folder named like one of ours (or like
    any dependency) cannot stand in for the installed package."""
    safe = ("-P",) if sys.version_info >= (3, 11) else ()
    return (sys.executable, *safe, "-m", module)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the supervisor dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class ServePlan:
    engine_cmd: tuple[str, ...]
    facade_cmd: tuple[str, ...]
    engine_addr: str
    facade_url: str
    facade_env: dict[str, str]
    ready_timeout_s: float
    engine_stop_s: float


class Supervisor:
    def __init__(self, plan: ServePlan) -> None:
        self.plan = plan
        self.stopping = False
        self.engine: subprocess.Popen | None = None
        self.facade: subprocess.Popen | None = None
        # The read end of the engine's readiness pipe. No gRPC client runs in this process: an
        # earlier health-probe channel hit grpc/grpc#38251 ("thd.h:170 Check failed: state_ ==
        # FAILED", an abort in gRPC core's thread start-up) twice under grpcio 1.71.2.
        self._ready_r: int | None = None

    def _on_signal(self, signum: int, frame) -> None:
        self.stopping = True

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._run()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _spawn(self, cmd: tuple[str, ...], env: dict[str, str] | None = None,
               pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True, pass_fds=pass_fds,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def _run(self) -> int:
        self._ready_r, ready_w = os.pipe()
        try:
            self.engine = self._spawn((*self.plan.engine_cmd, "--ready-fd", str(ready_w)), pass_fds=(ready_w,))
        finally:
            os.close(ready_w)
        try:
            if not self._wait(self._engine_serving, self.plan.ready_timeout_s, "the engine to load"):
                return 0 if self.stopping else 1
        finally:
            os.close(self._ready_r)
            self._ready_r = None
        self.facade = self._spawn(self.plan.facade_cmd, self.plan.facade_env)
        if not self._wait(self._facade_healthy, _FACADE_START_S, "the facade to listen"):
            return 0 if self.stopping else 1
        print(f"sluice serve: ready on {self.plan.facade_url} (engine {self.plan.engine_addr})",
              file=sys.stderr, flush=True)
        while not self.stopping:
            for name, proc in (("engine", self.engine), ("facade", self.facade)):
                rc = proc.poll()
                if rc is not None:
                    print(f"sluice serve: the {name} exited with code {rc}; stopping", file=sys.stderr, flush=True)
                    return rc if rc not in (0, None) else 1
            time.sleep(_POLL_S)
        return 0

    def _wait(self, ready, timeout_s: float, what: str) -> bool:
        """Poll ``ready()`` until true; False if a child died, a signal came or time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                return False
            for name, proc in (("engine", self.engine), ("facade", self.facade)):
                if proc is not None and proc.poll() is not None:
                    print(f"sluice serve: the {name} exited with code {proc.returncode} while waiting for {what}",
                          file=sys.stderr, flush=True)
                    return False
            if ready():
                return True
            time.sleep(_POLL_S)
        print(f"sluice serve: timed out after {timeout_s:.0f}s waiting for {what}", file=sys.stderr, flush=True)
        return False

    def _engine_serving(self) -> bool:
        """Whether the engine wrote "ready" (it closes the pipe unwritten if the model failed to
        load, and then exits, which _wait sees)."""
        readable, _, _ = select.select([self._ready_r], [], [], 0)
        return bool(readable) and os.read(self._ready_r, 16).startswith(b"ready")

    def _facade_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.plan.facade_url + "/health", timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _stop_all(self) -> None:
        # Both at once, each with the same grace: the facade stops listening and refuses new
        # requests, the engine refuses new ones too; what is in flight runs on for the grace,
        # then ends with an error event (the facade's, or the engine's abort). A child still
        # alive well after that is killed.
        procs = [p for p in (self.facade, self.engine) if p is not None and p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.plan.engine_stop_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d still running %.0fs after SIGTERM; killing it", proc.pid, self.plan.engine_stop_s)
                proc.kill()
                proc.wait()


def build_plan(args: argparse.Namespace) -> ServePlan:
    """Raises ValueError naming the flag for anything wrong, before a process starts."""
    _check_speculative(args.speculative_mode, args.additional_models)
    engine_port = args.engine_port or free_port()
    engine_addr = f"127.0.0.1:{engine_port}"
    config = facade_config(args, engine_addr)   # validates CORS lists, key file, body limit
    afs = afs_config(args)
    if any("," in k for k in config.auth.keys):
        raise ValueError("--api-key: keys must not contain commas")
    engine_cmd = (*python_module_cmd("sluice.engine.cli"), "engine", args.model, "--host", "127.0.0.1",
                  "--port", str(engine_port), "--device", args.device, "--mode", args.mode,
                  "--overrides", _with_engine_limits(args.overrides, config.limits), "--grace", str(args.grace))
    for flag, value in (("--embedding-model", args.embedding_model), ("--rerank-model", args.rerank_model),
                        ("--speculative-mode", args.speculative_mode), ("--additional-models", args.additional_models),
                        ("--quantization", getattr(args, "quantization", None))):
        if value is not None:   # unset: the engine's own default
            engine_cmd += (flag, value)
    facade_cmd = [*python_module_cmd("sluice.http_facade.cli"), "facade", "--engine", engine_addr,
                  "--host", args.host, "--port", str(args.port), "--max-body-bytes", str(args.max_body_bytes),
                  "--allowed-origins", args.allowed_origins, "--allowed-methods", args.allowed_methods,
                  "--allowed-headers", args.allowed_headers, "--limits", args.limits, "--grace", str(args.grace),
                  "--idle-timeout", str(args.idle_timeout), "--body-timeout", str(args.body_timeout)]
    if args.default_max_tokens is not None:
        facade_cmd += ["--default-max-tokens", str(args.default_max_tokens)]
    facade_cmd += ["--afs-ping-interval", str(afs.ping_interval_s)]
    if afs.query_prefix is not None:
        facade_cmd += ["--afs-query-prefix", afs.query_prefix]
    facade_cmd += ["--allow-credentials"] * args.allow_credentials + ["--enable-tracing"] * args.enable_tracing
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return ServePlan(engine_cmd, tuple(facade_cmd), engine_addr, f"http://{host}:{args.port}",
                     {ENV_KEYS: ",".join(config.auth.keys)}, args.ready_timeout, args.grace + 10.0)


# The engine's speculative modes (its CLI checks the rest: spec_* overrides, the draft's vocabulary,
# the heads' shapes), and what those that load more name with --additional-models.
_SPEC_MODES = ("disable", "ngram", "small_draft", "eagle", "medusa")
_NEEDS = {"small_draft": "a draft model", "eagle": "EAGLE heads (a folder)", "medusa": "Medusa heads (a folder)"}


def _check_speculative(mode: str | None, additional_models: str | None) -> None:
    if mode is not None and mode not in _SPEC_MODES:
        raise ValueError(f"--speculative-mode: must be one of {', '.join(_SPEC_MODES)}, got {mode!r}")
    if mode in _NEEDS and not additional_models:
        raise ValueError(f"--additional-models: --speculative-mode {mode} needs {_NEEDS[mode]}")
    if additional_models and mode not in _NEEDS:
        raise ValueError("--additional-models: only --speculative-mode small_draft, eagle or medusa load "
                         "additional models")


def _with_engine_limits(overrides: str, limits: RequestLimits) -> str:
    """The engine's overrides plus the caps it shares with the facade, so both enforce one set
    (an explicit override of the same key wins)."""
    given = {item.partition("=")[0].strip() for item in overrides.split(";")}
    extra = [f"{k}={getattr(limits, k)}" for k in ENGINE_KEYS
             if k not in given and getattr(limits, k) != getattr(RequestLimits(), k)]
    return ";".join(filter(None, [overrides.strip().rstrip(";"), *extra]))


def serve_from_args(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except ValueError as exc:
        print(f"sluice serve: error: {exc}", file=sys.stderr)
        return 2
    return Supervisor(plan).run()
