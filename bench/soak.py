"""Soak: random clients against a running ``sluice serve`` for ``--duration`` seconds, then the
figures that show a leak, at the start (after a warm-up) and at the end (once idle).

    # start sluice serve on a model and soak it for an hour
    python bench/soak.py --launch smollm2 --duration 3600
    # a server already running (facade URL; the engine's pid for its RSS / fds, if local)
    python bench/soak.py --url http://127.0.0.1:8000 --engine-pid 1234 --duration 600 --json soak.json

Clients (``--concurrency`` at once, each picks at random, seeded by ``--seed``): a stream read to
its end; a stream dropped after a few events (disconnect); a non-streaming request abandoned
by a short client timeout (cancellation); a chat; an invalid body (400). Figures: the facade's
RSS, open fds and live asyncio tasks (its ``/metrics``: ``process_*``, ``sluice_facade_asyncio_tasks``),
the engine's RSS, fds and threads (``/proc``, when its pid is known) and the KV blocks in use
and in total. Prints one JSON object: ``start``, ``end``, ``counts``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 200   # completions ask for 1..MAX_TOKENS tokens unless --max-tokens says otherwise
IDLE_GAUGES = ("sluice_num_requests_running", "sluice_num_requests_waiting", "sluice_num_requests_in_flight",
               "sluice_kv_cache_blocks_used")
FACADE_FIGURES = {"process_resident_memory_bytes": "facade_rss_bytes", "process_open_fds": "facade_fds",
                  "sluice_facade_asyncio_tasks": "facade_tasks", "sluice_kv_cache_blocks_used": "kv_blocks_used",
                  "sluice_kv_cache_blocks_total": "kv_blocks_total"}


def _proc_figures(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    field = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines()}
    return {"engine_rss_bytes": int(field["VmRSS"][0]) * 1024, "engine_fds": len(os.listdir(f"/proc/{pid}/fd")),
            "engine_threads": int(field["Threads"][0])}


async def _gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#") and len(line.split()) == 2}


async def figures(session: aiohttp.ClientSession, url: str, engine_pid: int | None,
                  idle_timeout: float = 60) -> dict[str, float]:
    """Waits until the engine is idle (or ``idle_timeout``), then reads every figure."""
    deadline = time.monotonic() + idle_timeout
    while True:
        g = await _gauges(session, url)
        if all(g.get(k, 1) == 0 for k in IDLE_GAUGES) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    out = {name: g[key] for key, name in FACADE_FIGURES.items() if key in g}
    out["idle"] = all(g.get(k, 1) == 0 for k in IDLE_GAUGES)
    if engine_pid is not None:
        out |= _proc_figures(engine_pid)
    return out


class Clients:
    def __init__(self, url: str, model: str, seed: int, max_tokens: int = MAX_TOKENS) -> None:
        self.url, self.model, self.rng, self.max_tokens = url, model, random.Random(seed), max_tokens
        self.counts: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _body(self, stream: bool) -> dict:
        words = " ".join(f"w{self.rng.randrange(100)}" for _ in range(self.rng.randint(1, 60)))
        return {"model": self.model, "prompt": words, "max_tokens": self.rng.randint(1, self.max_tokens),
                "stream": stream, "ignore_eos": self.rng.random() < 0.5, "temperature": self.rng.choice([0, 0.8])}

    async def one(self, session: aiohttp.ClientSession) -> None:
        kind = self.rng.choice(["stream", "disconnect", "timeout", "chat", "invalid"])
        try:
            if kind in ("stream", "disconnect"):
                drop_after = self.rng.randint(1, 8) if kind == "disconnect" else None
                async with session.post(self.url + "/v1/completions", json=self._body(True)) as r:
                    seen = 0
                    async for _ in r.content:
                        seen += 1
                        if drop_after is not None and seen >= drop_after:
                            break          # leaving the block closes the connection mid-stream
                    status = r.status
            elif kind == "timeout":
                t = aiohttp.ClientTimeout(total=self.rng.uniform(0.01, 0.3))
                async with session.post(self.url + "/v1/completions", json=self._body(False), timeout=t) as r:
                    await r.read()
                    status = r.status
            elif kind == "chat":
                body = {"model": self.model, "messages": [{"role": "user", "content": "w1 w2 w3"}],
                        "max_tokens": self.rng.randint(1, 50)}
                async with session.post(self.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    status = r.status
            else:
                async with session.post(self.url + "/v1/completions", json={"model": self.model, "n": "x"}) as r:
                    await r.read()
                    status = r.status
            self._count(f"{kind} {status}")
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            self._count(f"{kind} {type(exc).__name__}")

    async def worker(self, session: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            await self.one(session)


async def _load(clients: Clients, url: str, seconds: float, concurrency: int) -> None:
    until = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(clients.worker(session, until) for _ in range(concurrency)))


async def _figures_now(url: str, engine_pid: int | None) -> dict:
    # A session of its own: the load's keep-alive connections (and their facade tasks) are closed.
    async with aiohttp.ClientSession() as session:
        return await figures(session, url, engine_pid)


async def soak(url: str, duration: float, concurrency: int, seed: int, engine_pid: int | None,
               warmup: float = 10.0, sample_every: float | None = None, max_tokens: int = MAX_TOKENS) -> dict:
    """``sample_every``: also take the figures (idle, so the load pauses for them) every so many
    seconds of load: a leak grows steadily, a cache filling up levels off."""
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    clients = Clients(url, model, seed, max_tokens)
    await _load(clients, url, warmup, concurrency)        # allocator arenas, caches, batch shapes
    start = await _figures_now(url, engine_pid)
    samples, done = [], 0.0
    step = sample_every if sample_every and sample_every > 0 else duration
    while done < duration:
        part = min(step, duration - done)
        await _load(clients, url, part, concurrency)
        done += part
        if done < duration:
            samples.append({"load_s": done, **await _figures_now(url, engine_pid)})
    end = await _figures_now(url, engine_pid)
    out = {"start": start, "end": end, "counts": dict(sorted(clients.counts.items())),
           "requests": sum(clients.counts.values()), "duration_s": duration, "warmup_s": warmup,
           "concurrency": concurrency}
    if samples:
        out["samples"] = samples
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, overrides: str, log: Path) -> tuple[subprocess.Popen, str, int]:
    """``sluice serve MODEL`` on a free port; returns (process, URL, engine pid) once ready."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sluice.engine.cli", "serve", model, "--device", "cpu",
                                 "--port", str(port), "--embedding-model", "none", "--overrides", overrides],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sluice serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if "ready on" in log.read_text(errors="replace"):
            break
        time.sleep(0.2)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    engine = next(int(c) for c in children
                  if b"sluice.engine.cli\x00engine\x00" in Path(f"/proc/{c}/cmdline").read_bytes())
    return proc, url, engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running facade")
    where.add_argument("--launch", metavar="MODEL", help="start sluice serve on MODEL (a name or a folder)")
    p.add_argument("--engine-pid", type=int, default=None, help="with --url: the engine's pid, for its figures")
    p.add_argument("--overrides", default="max_num_sequence=8;max_waiting=16;max_total_seq_length=1024",
                   help="with --launch: engine overrides")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of load after the warm-up")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before the start figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="completions ask for 1..N tokens (fewer: more requests, and so more chances to leak, a second)")
    p.add_argument("--sample-every", type=float, default=None, metavar="S",
                   help="also take the figures every S seconds of load (the result's samples)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    proc = None
    url, engine_pid = args.url, args.engine_pid
    if args.launch:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sluice-soak-{os.getpid()}.log"
        print(f"sluice serve's log: {log}", file=sys.stderr, flush=True)   # kept: an hour's run may need reading
        proc, url, engine_pid = launch(args.launch, args.overrides, log)
    try:
        result = asyncio.run(soak(url, args.duration, args.concurrency, args.seed, engine_pid, args.warmup,
                                   args.sample_every, args.max_tokens))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
