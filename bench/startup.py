"""Startup benchmark: how long ``sluice serve MODEL`` takes to answer ``GET /ready`` with 200,
and the first request's TTFT after that.

    python bench/startup.py --model smollm2 --runs 3
    python bench/startup.py --model /tmp/b1/Q4_K_M.gguf --runs 5 --mode server --log-dir /tmp/startup-logs

Each run starts ``python -m sluice.engine.cli serve MODEL --device cpu`` (what the ``sluice``
command runs), polls ``/ready`` every ``--poll-ms`` (20 ms: the finer the poll, the less it adds
to the figure; bench/serving.py polls every 0.5 s), then sends one streamed completion of a short
prompt (``--max-tokens`` tokens, greedy) and takes its TTFT (request sent → first content chunk),
then stops the server (SIGTERM to its process group) before the next run starts. The server's
stderr lines are stamped with their arrival time since spawn; ``--log-dir`` keeps them, which is
how the start-up is split into its phases (imports, engine listening, model loaded, facade
listening). Runs are sequential and alone on the machine; the page cache is left warm (the
first run warms it). A caller's PYTHONPATH reaches the server, so a package folder linking
``sluice`` to a worktree measures that worktree.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "The three longest rivers of Europe are the"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _model_name(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10.0) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _first_token_s(url: str, model: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) of one streamed completion, in seconds."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    try:
        resp = urllib.request.urlopen(req, timeout=120.0)
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"the completion failed: {err.code} {err.read()[:500]!r}") from None
    with resp:
        for raw in resp:
            line = raw.decode().strip()
            if ttft is None and line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.monotonic() - t0
    if ttft is None:
        raise RuntimeError("the completion streamed no text")
    return ttft, time.monotonic() - t0


def _stamp_lines(stream, t0: float, lines: list[tuple[float, str]]) -> None:
    for raw in stream:
        lines.append((time.monotonic() - t0, raw.decode(errors="replace").rstrip()))


def _cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """The host's CPU time spent busy over ``interval_s`` (/proc/stat; 0.0 where it is missing)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]          # total, idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_until_idle(max_busy: float, timeout_s: float) -> None:
    """On a shared host, wait (up to ``timeout_s``) until another job's work (a compile, a
    benchmark) has stopped: a second with at most ``max_busy`` of the CPUs busy."""
    deadline = time.monotonic() + timeout_s
    while _cpu_busy_fraction() > max_busy and time.monotonic() < deadline:
        pass


def one_run(args: argparse.Namespace) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sluice.engine.cli", "serve", args.model, "--device", "cpu", "--mode", args.mode,
           "--port", str(port), *args.extra]
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
    reader = threading.Thread(target=_stamp_lines, args=(proc.stderr, t0, lines), daemon=True)
    reader.start()
    try:
        deadline = t0 + args.timeout
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n" +
                                   "\n".join(text for _, text in lines[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {args.timeout:.0f}s")
            time.sleep(args.poll_ms / 1000)
        ready_s = time.monotonic() - t0
        # The name is asked for outside the TTFT (a client knows it; /v1/models runs no model).
        ttft_s, e2e_s = _first_token_s(url, _model_name(url), args.max_tokens)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(5)
    return {"ready_s": ready_s, "ttft_s": ttft_s, "e2e_s": e2e_s, "lines": lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--mode", default="server", choices=("local", "interactive", "server"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--poll-ms", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", type=Path, default=None, help="write each run's stamped stderr here")
    ap.add_argument("--max-busy", type=float, default=0.1,
                    help="before each run, wait for a second with at most this fraction of the CPUs busy "
                         "(another job on a shared host; 1 waits for nothing; default: 0.1)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("extra", nargs="*", help="more `sluice serve` arguments (after --)")
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        wait_until_idle(args.max_busy, timeout_s=120.0)
        r = one_run(args)
        results.append(r)
        print(f"run {i + 1}: ready {r['ready_s']:.2f} s, first request TTFT {r['ttft_s'] * 1000:.0f} ms "
              f"(e2e {r['e2e_s'] * 1000:.0f} ms)", flush=True)
        if args.log_dir is not None:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            (args.log_dir / f"run{i + 1}.log").write_text(
                "".join(f"{t:7.3f}  {text}\n" for t, text in r["lines"]))
    ready = [r["ready_s"] for r in results]
    ttft = [r["ttft_s"] * 1000 for r in results]
    print(f"{args.model}: ready median {statistics.median(ready):.2f} s (min {min(ready):.2f}, max {max(ready):.2f}); "
          f"first TTFT median {statistics.median(ttft):.0f} ms (min {min(ttft):.0f}, max {max(ttft):.0f}); "
          f"{len(results)} runs", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "lines"} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
