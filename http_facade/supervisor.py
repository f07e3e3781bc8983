"""``sluice serve``: the engines and the facade as child processes, supervised.

Start each engine (``python -m sluice.engine.cli engine MODEL --port <free port> --ready-fd N``):
one, or ``--data-parallel N`` replicas of the model (each on its share of the cores, or on its
own GPU), plus one per model of ``--additional-models`` when no speculative mode uses them. Wait
for each to write "ready" to its pipe (it does once its gRPC health says SERVING) while the
facade (``python -m sluice.http_facade.cli facade --engine A --engine B ...``) starts beside them,
wait for the facade's ``/ready``, then watch them all:

* the facade exits, or the only engine → the rest are stopped and ``serve`` exits non-zero
  (never a hung port);
* one engine of several exits → the facade routes around it, and it is started again after
  ``_RESTART_DELAY_S`` (at most ``_MAX_RESTARTS`` times in ``_RESTART_WINDOW_S``; then it stays
  down, and ``serve`` ends when no engine is left);
* SIGTERM / SIGINT → the facade stops taking requests, the engines drain, exit 0.

Children get their own session (terminal signals reach only the supervisor, which forwards
them in order) and, on Linux, a parent-death signal so that they do not outlive a killed
supervisor. API keys reach the facade through its environment, not its command line.
"""
from __future__ import annotations

import argparse
import json
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
from sluice.http_facade.options import afs_config, facade_config, operations_flags
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
    """In a child (preexec): SIGTERM it when the supervisor dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class EngineSpec:
    cmd: tuple[str, ...]
    addr: str
    env: dict[str, str]
    cpus: tuple[int, ...] | None     # the cores it may run on (several engines on one host)
    label: str


@dataclass(frozen=True)
class ServePlan:
    engines: tuple[EngineSpec, ...]
    facade_cmd: tuple[str, ...]
    facade_url: str
    facade_env: dict[str, str]
    ready_timeout_s: float
    engine_stop_s: float

    @property
    def engine_addr(self) -> str:
        return self.engines[0].addr

    @property
    def engine_cmd(self) -> tuple[str, ...]:
        return self.engines[0].cmd


# With several engines, one that dies is started again after a pause (the facade routes around
# it meanwhile), at most this many times in _RESTART_WINDOW_S; then it stays down.
_MAX_RESTARTS = 3
_RESTART_WINDOW_S = 600.0
_RESTART_DELAY_S = 2.0


class Supervisor:
    def __init__(self, plan: ServePlan) -> None:
        self.plan = plan
        self.stopping = False
        self.engines: list[subprocess.Popen | None] = [None] * len(plan.engines)
        self.facade: subprocess.Popen | None = None
        self._restarts: list[list[float]] = [[] for _ in plan.engines]
        self._down_since: list[float | None] = [None] * len(plan.engines)
        # The read ends of the engines' readiness pipes. No gRPC client runs in this process: an
        # earlier health-probe channel hit grpc/grpc#38251 ("thd.h:170 Check failed: state_ ==
        # FAILED", an abort in gRPC core's thread start-up) twice under grpcio 1.71.2.
        self._ready_r: list[int] = []

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
               pass_fds: tuple[int, ...] = (), cpus: tuple[int, ...] | None = None) -> subprocess.Popen:
        def prepare() -> None:
            if sys.platform.startswith("linux"):
                _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)
        return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True, pass_fds=pass_fds,
                                preexec_fn=prepare)

    def _start_engine(self, i: int, ready: bool) -> None:
        spec = self.plan.engines[i]
        if not ready:
            self.engines[i] = self._spawn(spec.cmd, spec.env, cpus=spec.cpus)
            return
        ready_r, ready_w = os.pipe()
        self._ready_r.append(ready_r)
        try:
            self.engines[i] = self._spawn((*spec.cmd, "--ready-fd", str(ready_w)), spec.env, (ready_w,), spec.cpus)
        finally:
            os.close(ready_w)

    def _children(self) -> list[tuple[str, subprocess.Popen | None]]:
        return [(spec.label, p) for spec, p in zip(self.plan.engines, self.engines)] + [("facade", self.facade)]

    def _run(self) -> int:
        for i in range(len(self.plan.engines)):
            self._start_engine(i, ready=True)
        # The facade starts while the engines load (its start-up, ~1 s of imports, overlaps
        # theirs); it marks an engine up at its first SERVING health check, so "ready" waits for
        # its /ready after the engines' pipes: the first request finds the engines routed to.
        self.facade = self._spawn(self.plan.facade_cmd, self.plan.facade_env)
        try:
            what = "the engine to load" if len(self.engines) == 1 else "the engines to load"
            if not self._wait(self._engines_serving, self.plan.ready_timeout_s, what):
                return 0 if self.stopping else 1
        finally:
            for fd in self._ready_r:
                if fd >= 0:
                    os.close(fd)
            self._ready_r = []
        if not self._wait(self._facade_ready, _FACADE_START_S, "the facade to see the engines"):
            return 0 if self.stopping else 1
        addrs = ", ".join(e.addr for e in self.plan.engines)
        print(f"sluice serve: ready on {self.plan.facade_url} (engine{'s' * (len(self.engines) > 1)} {addrs})",
              file=sys.stderr, flush=True)
        while not self.stopping:
            rc = self.facade.poll()
            if rc is not None:
                print(f"sluice serve: the facade exited with code {rc}; stopping", file=sys.stderr, flush=True)
                return rc or 1
            for i, proc in enumerate(self.engines):
                rc = proc.poll() if proc is not None else None
                if rc is not None and not self._engine_died(i, rc):
                    return rc or 1
            time.sleep(_POLL_S)
        return 0

    def _engine_died(self, i: int, rc: int) -> bool:
        """An engine exited: True while serving goes on (several engines: it is restarted after
        a pause, or left down when it keeps dying and others are alive)."""
        label = self.plan.engines[i].label
        now = time.monotonic()
        if len(self.engines) == 1:
            print(f"sluice serve: the {label} exited with code {rc}; stopping", file=sys.stderr, flush=True)
            return False
        if self._down_since[i] is None:
            self._down_since[i] = now
            print(f"sluice serve: the {label} exited with code {rc}; the facade routes around it",
                  file=sys.stderr, flush=True)
        recent = [t for t in self._restarts[i] if now - t < _RESTART_WINDOW_S]
        self._restarts[i] = recent
        if len(recent) >= _MAX_RESTARTS:
            self.engines[i] = None
            print(f"sluice serve: the {label} died {len(recent) + 1} times in {_RESTART_WINDOW_S:.0f}s; "
                  "leaving it down", file=sys.stderr, flush=True)
            alive = [p for p in self.engines if p is not None and p.poll() is None]
            return bool(alive)
        if now - self._down_since[i] >= _RESTART_DELAY_S:
            self._restarts[i].append(now)
            self._down_since[i] = None
            print(f"sluice serve: starting the {label} again", file=sys.stderr, flush=True)
            self._start_engine(i, ready=False)
        return True

    def _wait(self, ready, timeout_s: float, what: str) -> bool:
        """Poll ``ready()`` until true; False if a child died, a signal came or time ran out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                return False
            for name, proc in self._children():
                if proc is not None and proc.poll() is not None:
                    print(f"sluice serve: the {name} exited with code {proc.returncode} while waiting for {what}",
                          file=sys.stderr, flush=True)
                    return False
            if ready():
                return True
            time.sleep(_POLL_S)
        print(f"sluice serve: timed out after {timeout_s:.0f}s waiting for {what}", file=sys.stderr, flush=True)
        return False

    def _engines_serving(self) -> bool:
        """Whether every engine wrote "ready" (one closes its pipe unwritten if its model failed
        to load, and then exits, which _wait sees)."""
        pending = [fd for fd in self._ready_r if fd >= 0]
        if pending:
            readable, _, _ = select.select(pending, [], [], 0)
            for fd in readable:
                if os.read(fd, 16).startswith(b"ready"):
                    self._ready_r[self._ready_r.index(fd)] = -1
                    os.close(fd)
        return all(fd < 0 for fd in self._ready_r)

    def _facade_ready(self) -> bool:
        """The facade's /ready is 200 and lists every engine as serving: each engine has just
        said it is ready, but the facade, started before they listened, may still be waiting out
        a reconnect to one of them; until it has seen them all, it would route to the others."""
        try:
            with urllib.request.urlopen(self.plan.facade_url + "/ready", timeout=2.0) as resp:
                if resp.status != 200:
                    return False
                engines = json.loads(resp.read()).get("engines") or []
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return len(engines) == len(self.engines) and all(e.get("serving") for e in engines)

    def _stop_all(self) -> None:
        # All at once, each with the same grace: the facade stops listening and refuses new
        # requests, the engines refuse new ones too; what is in flight runs on for the grace,
        # then ends with an error event (the facade's, or the engine's abort). A child still
        # alive well after that is killed.
        procs = [p for _, p in self._children() if p is not None and p.poll() is None]
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
    additional = _additional_models(args)
    _check_speculative(args.speculative_mode, additional)
    replicas = args.data_parallel
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"--data-parallel: must be a positive number of engines, got {replicas!r}")
    plain_extra = additional if args.speculative_mode not in _NEEDS else []
    models = [args.model] * replicas + plain_extra
    if args.engine_port and len(models) > 1:
        raise ValueError("--engine-port: one port cannot serve several engines (leave it out)")
    ports = [args.engine_port or free_port()] if len(models) == 1 else [free_port() for _ in models]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    config = facade_config(args, addrs)   # validates CORS lists, key file, body limit
    afs = afs_config(args)
    if any("," in k for k in config.auth.keys):
        raise ValueError("--api-key: keys must not contain commas")
    shares = _shares(len(models), args.device)
    engines = []
    for i, (model, port) in enumerate(zip(models, ports)):
        cmd = (*python_module_cmd("sluice.engine.cli"), "engine", model, "--host", "127.0.0.1",
               "--port", str(port), "--device", args.device, "--mode", args.mode,
               "--overrides", _with_engine_limits(args.overrides, config.limits), "--grace", str(args.grace))
        spec_extra = ",".join(additional) if args.speculative_mode in _NEEDS and i < replicas else None
        for flag, value in (("--embedding-model", args.embedding_model), ("--rerank-model", args.rerank_model),
                            ("--speculative-mode", args.speculative_mode if i < replicas else None),
                            ("--additional-models", spec_extra),
                            ("--quantization", getattr(args, "quantization", None)),
                            ("--tensor-parallel-size", _str_or_none(getattr(args, "tensor_parallel_size", None))),
                            ("--otlp-traces-endpoint", args.otlp_traces_endpoint)):
            if value is not None:   # unset: the engine's own default
                cmd += (flag, value)
        label = "engine" if len(models) == 1 else f"engine {i} ({model})"
        engines.append(EngineSpec(cmd, addrs[i], shares[i][1], shares[i][0], label))
    facade_cmd = [*python_module_cmd("sluice.http_facade.cli"), "facade"]
    for addr in addrs:
        facade_cmd += ["--engine", addr]
    facade_cmd += ["--host", args.host, "--port", str(args.port), "--max-body-bytes", str(args.max_body_bytes),
                   "--allowed-origins", args.allowed_origins, "--allowed-methods", args.allowed_methods,
                   "--allowed-headers", args.allowed_headers, "--limits", args.limits, "--grace", str(args.grace),
                   "--idle-timeout", str(args.idle_timeout), "--body-timeout", str(args.body_timeout),
                   "--routing", args.routing]
    if args.default_max_tokens is not None:
        facade_cmd += ["--default-max-tokens", str(args.default_max_tokens)]
    facade_cmd += ["--afs-ping-interval", str(afs.ping_interval_s)]
    if afs.query_prefix is not None:
        facade_cmd += ["--afs-query-prefix", afs.query_prefix]
    facade_cmd += ["--allow-credentials"] * args.allow_credentials + ["--enable-tracing"] * args.enable_tracing
    facade_cmd += operations_flags(args)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return ServePlan(tuple(engines), tuple(facade_cmd), f"http://{host}:{args.port}",
                     {ENV_KEYS: ",".join(config.auth.keys)}, args.ready_timeout, args.grace + 10.0)


def _str_or_none(value) -> str | None:
    return None if value is None else str(value)


def _additional_models(args: argparse.Namespace) -> list[str]:
    given = args.additional_models or []
    if isinstance(given, str):
        given = [given]
    return [m.strip() for item in given for m in item.split(",") if m.strip()]


def _shares(n: int, device: str) -> list[tuple[tuple[int, ...] | None, dict[str, str]]]:
    """Each of ``n`` engines' cores and environment. One engine: all of them, as given. Several:
    on CUDA one device each (``CUDA_VISIBLE_DEVICES``); on CPU an equal share of this process's
    cores each (affinity, and as many OpenMP threads unless OMP_NUM_THREADS asks for fewer)."""
    if n == 1:
        return [(None, {})]
    if device.startswith("cuda") and ":" not in device:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(n)]
        return [(None, {"CUDA_VISIBLE_DEVICES": ids[i % len(ids)]}) for i in range(n)]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // n)
    asked = os.environ.get("OMP_NUM_THREADS")
    out = []
    for i in range(n):
        mine = tuple(cores[i * per:(i + 1) * per]) if (i + 1) * per <= len(cores) else (cores[i % len(cores)],)
        threads = min(len(mine), int(asked)) if asked and asked.isdigit() and int(asked) > 0 else len(mine)
        out.append((mine, {"OMP_NUM_THREADS": str(threads)}))
    return out


# The engine's speculative modes (its CLI checks the rest: spec_* overrides, the draft's vocabulary,
# the heads' shapes), and what those that load more name with --additional-models.
_SPEC_MODES = ("disable", "ngram", "small_draft", "eagle", "medusa")
_NEEDS = {"small_draft": "a draft model", "eagle": "EAGLE heads (a folder)", "medusa": "Medusa heads (a folder)"}


def _check_speculative(mode: str | None, additional_models: list[str]) -> None:
    if mode is not None and mode not in _SPEC_MODES:
        raise ValueError(f"--speculative-mode: must be one of {', '.join(_SPEC_MODES)}, got {mode!r}")
    if mode in _NEEDS and not additional_models:
        raise ValueError(f"--additional-models: --speculative-mode {mode} needs {_NEEDS[mode]}")
    if additional_models and mode not in (None, "disable", *_NEEDS):
        raise ValueError(f"--additional-models: only --speculative-mode small_draft, eagle or medusa load "
                         f"additional models ({mode} uses none); without a speculative mode they are served "
                         "as models of their own")
    if mode in _NEEDS and len(additional_models) > 1:
        raise ValueError(f"--additional-models: --speculative-mode {mode} takes one, got {len(additional_models)}")


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
