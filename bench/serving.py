"""Serving benchmark: a load generator for OpenAI-compatible servers and sluice's gRPC API.

Targets: sluice's facade, a peer such as llama.cpp's server, or sluice's gRPC engine directly; the
peer is measured in the same run and our figures are printed as ratios to it.

    # start sluice (facade + engine) and llama.cpp's server on the same GGUF, sweep concurrency
    python bench/serving.py --launch http --peer llamacpp --concurrency 1,8,32 --num-prompts 64 \
        --input-len 128 --output-len 64 --slo-ttft-ms 2000 --slo-tpot-ms 200 --json out.json --plot charts/
    # servers already running; Poisson arrivals at 2 and 4 requests/s over the conversation set
    python bench/serving.py --url http://127.0.0.1:8000 --peer-url http://127.0.0.1:8001 \
        --dataset conversations --request-rate 2,4
    # the gRPC API directly
    python bench/serving.py --grpc 127.0.0.1:50051 --concurrency 4

Prompts. ``synthetic``: random common words cut to exactly ``--input-len`` tokens with the model's
own tokenizer (read locally from the GGUF, the file both servers load), sent as text so that every
server accepts them (``--prompt-format ids`` sends the token ids instead, where a server takes them);
the server's ``usage.prompt_tokens`` is reported beside the target. Outputs run to exactly
``--output-len`` tokens (``ignore_eos`` plus a -100 logit bias on the end tokens, for servers
without ``ignore_eos``). ``conversations``: ``bench/data/conversations.jsonl`` through
``/v1/chat/completions`` (greedy; natural stops, capped by each chat's ``max_tokens``).
``grounded`` / ``open``: the chat prompts of ``bench/prompts.py`` (input-grounded edits and
rewrites, where n-gram speculation finds matches; open-ended questions), greedy, natural stops,
``--output-len`` (default 128) tokens at most.

Every load point gets prompts of its own (synthetic: drawn afresh; the fixed sets: taken in turn
from the set), and the warm-up's prompts are not measured ones. The targets take turns at each
load point; ``--rounds R`` makes that R turns each, with prompts of its own per round, so that a
host whose speed drifts within minutes slows every target alike (a ratio from one turn each can
move by tens of percent between runs there). Reusing the prompts of an earlier
load point measures prefix caching instead: llama-server keeps each slot's last prompt, so at
``--concurrency 1,32`` its 32 slots would still hold the 32 prompts of the c=1 pass and its
"burst" would prefill one token per request. ``--repeat-prompts`` asks for exactly that.

Startup and memory (servers this run starts). Servers start one after another, each alone on the
machine: ``ready s`` is spawn → first successful ``/v1/models`` (or gRPC health SERVING), which is
the model load plus process start-up; ``--cold`` first evicts the model file from the page cache
(``posix_fadvise(DONTNEED)``; pages still mapped by another process stay). After the last load
point, each server's process tree is read from ``/proc``: resident memory now (VmRSS summed over
its process tree) and the peak (VmHWM summed: an upper bound, the processes' peaks need not
coincide).

Metrics. TTFT: request sent → first non-empty content chunk. TPOT = (E2E − TTFT) / (output
tokens − 1). ITL: gaps between content chunks. Output tokens come from the server's usage
(``stream_options.include_usage``), never from counting text. A server that streams no usage
(llama-cpp-python's) is credited ``max_tokens`` only when it ends the stream with
``finish_reason: length`` (its own statement that it hit the limit; synthetic outputs ban EOS so
they always do); any other stream without usage counts as a failed request. Goodput: requests/s (and their output tokens/s) meeting every SLO given.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from prompts import GROUNDED, OPEN  # noqa: E402

START_TIMEOUT_S = 300.0
CONVERSATIONS = Path(__file__).resolve().parent / "data" / "conversations.jsonl"
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education river garden window table paper music market field light "
         "summer winter green stone bread letter bridge island forest village horse letter engine ocean").split()


# ------------------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Item:
    """One request of the workload."""
    kind: str                              # completion | chat
    max_tokens: int
    exact: bool                            # force exactly max_tokens (ignore EOS)
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None


def _load_tokenizer(model: str):
    from sluice.engine.loaders import resolve_path
    from sluice.engine.loaders.gguf_loader import open_gguf
    from sluice.engine.tokenizer import Tokenizer

    path = resolve_path(model)
    if path.suffix != ".gguf":
        return Tokenizer.from_folder(path)
    return Tokenizer.from_gguf(open_gguf(path), path)


def _exact_prompt(tok, rng: random.Random, length: int) -> tuple[str, list[int]]:
    """Random words whose text re-encodes to exactly ``length`` tokens."""
    for _ in range(50):
        words = [rng.choice(WORDS) for _ in range(length + 8)]
        ids = tok.encode(" ".join(words), add_special_tokens=False)[:length]
        text = tok.decode(ids)
        if tok.encode(text, add_special_tokens=False) == ids:
            return text, ids
    raise RuntimeError(f"input-len: could not build a prompt of exactly {length} tokens")


def synthetic_items(tok, n: int, input_len: int, output_len: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        text, ids = _exact_prompt(tok, rng, input_len)
        items.append(Item("completion", output_len, True, text=text, token_ids=tuple(ids)))
    return items


def chat_items(prompts: list[str], n: int, output_len: int, start: int = 0) -> list[Item]:
    """``n`` single-turn chats taken in turn from ``prompts``, from index ``start``."""
    return [Item("chat", output_len, False, messages=({"role": "user", "content": prompts[(start + i) % len(prompts)]},))
            for i in range(n)]


def conversation_items(path: Path, n: int, output_len: int | None) -> list[Item]:
    convs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not convs:
        raise ValueError(f"dataset: {path} holds no conversations")
    return [Item("chat", output_len or c["max_tokens"], False, messages=tuple(c["messages"]))
            for c in (convs[i % len(convs)] for i in range(n))]


# ------------------------------------------------------------------------------ requests
@dataclass
class Record:
    ok: bool
    ttft: float = 0.0                      # seconds
    e2e: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # seconds since send, per content chunk
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    usage_source: str = "usage"            # usage | finish_reason=length


def _openai_body(item: Item, target: Target, prompt_format: str, stop_ids: list[int]) -> tuple[str, dict]:
    body: dict = {"model": target.model, "max_tokens": item.max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if item.exact:
        body["ignore_eos"] = True
        body["logit_bias"] = {str(t): -100 for t in stop_ids}
    if item.kind == "chat":
        body["messages"] = list(item.messages)
        return "/v1/chat/completions", body
    body["prompt"] = list(item.token_ids) if prompt_format == "ids" else item.text
    return "/v1/completions", body


async def openai_request(session: aiohttp.ClientSession, target: Target, item: Item, prompt_format: str,
                         stop_ids: list[int]) -> Record:
    path, body = _openai_body(item, target, prompt_format, stop_ids)
    rec, usage, finish = Record(ok=False), None, None
    t0 = time.perf_counter()
    try:
        async with session.post(target.address + path, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("error"):
                    rec.error = str(event["error"])[:200]
                    return rec
                for choice in event.get("choices") or []:
                    piece = choice.get("text") if item.kind == "completion" else (choice.get("delta") or {}).get("content")
                    if piece:
                        rec.chunk_times.append(time.perf_counter() - t0)
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
        return rec
    if usage is None and finish == "length":
        # No streamed usage (llama-cpp-python's server), but the server says it stopped at the
        # max_tokens limit: that is its own count of the output. The prompt count stays unknown.
        rec.usage_source = "finish_reason=length"
        return _finish(rec, t0, (0, item.max_tokens))
    return _finish(rec, t0, usage and (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)))


async def grpc_request(client, item: Item, stop_ids: list[int]) -> Record:
    from sluice.engine.client import EngineRpcError

    kw = dict(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=item.exact or None)
    rec, usage = Record(ok=False), None
    t0 = time.perf_counter()
    try:
        stream = (client.chat(list(item.messages), **kw) if item.kind == "chat"
                  else client.generate(list(item.token_ids), **kw))
        async for delta in stream:
            if delta.token_ids:
                rec.chunk_times.append(time.perf_counter() - t0)
            if delta.finished:
                if delta.error:
                    rec.error = delta.error
                    return rec
                usage = delta.usage and (delta.usage.prompt_tokens, delta.usage.completion_tokens)
    except EngineRpcError as exc:
        rec.error = str(exc)[:200]
        return rec
    return _finish(rec, t0, usage)


def _finish(rec: Record, t0: float, usage: tuple[int, int] | None) -> Record:
    rec.e2e = time.perf_counter() - t0
    if usage is None:
        rec.error = "no usage in the stream (the server ignores stream_options.include_usage)"
    elif not rec.chunk_times:
        rec.error = "no content chunk in the stream"
    else:
        rec.prompt_tokens, rec.output_tokens = usage
        rec.ttft = rec.chunk_times[0]
        rec.ok = True
    return rec


# ------------------------------------------------------------------------------ targets
@dataclass
class Target:
    name: str
    kind: str                              # openai | grpc
    address: str                           # base URL or host:port
    is_peer: bool = False
    model: str = ""                        # the "model" field of request bodies, from /v1/models
    proc: subprocess.Popen | None = None   # set when this script started the server
    log_path: Path | None = None
    ready_s: float | None = None           # spawn -> ready, for a server this run started

    def sender(self, session: aiohttp.ClientSession, prompt_format: str, stop_ids: list[int], clients: list):
        if self.kind == "grpc":
            from sluice.engine.client import AsyncEngineClient
            client = AsyncEngineClient(self.address)   # bound to the running loop
            clients.append(client)
            return lambda item: grpc_request(client, item, stop_ids)
        return lambda item: openai_request(session, self, item, prompt_format, stop_ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(name: str, cmd: list[str], logdir: Path, threads: int) -> tuple[subprocess.Popen, Path]:
    log_path = logdir / f"{name}.log"
    # A caller's PYTHONPATH stays in front: a package folder linking `sluice` to another checkout
    # (a git worktree of a branch, against the installed one) is how two versions are compared.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
    env = {**os.environ, "PYTHONPATH": path, "SLUICE_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "wb") as log:
        # Own session: `sluice serve` has children, and stopping the group stops them all.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"started {name}: {' '.join(cmd)} (log {log_path})", flush=True)
    return proc, log_path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def evict_from_page_cache(path: Path) -> None:
    """Drop a file's clean, unmapped pages from the page cache, so the next read is a cold one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _kib(status: str, key: str) -> int:
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def tree_memory(pid: int) -> dict:
    """Resident memory of process ``pid`` and all its descendants (``sluice serve`` is a
    supervisor with an engine and a facade under it): MiB now, and the sum of the processes'
    peaks."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                # The parent pid follows the parenthesised command name, which may hold spaces.
                children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    rss = hwm = n = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        rss += _kib(status, "VmRSS")
        hwm += _kib(status, "VmHWM")
        n += 1
    return {"processes": n, "rss_mib": rss / 1024, "peak_rss_mib": hwm / 1024}


def _wait_ready(t: Target, timeout: float = START_TIMEOUT_S) -> None:
    """Until the server answers (HTTP: GET /v1/models, whose first id becomes ``t.model``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if t.proc is not None and t.proc.poll() is not None:
            tail = t.log_path.read_text(errors="replace")[-3000:] if t.log_path else ""
            raise RuntimeError(f"{t.name} exited with {t.proc.returncode} while starting:\n{tail}")
        try:
            if t.kind == "grpc":
                from sluice.engine.client import EngineClient, EngineRpcError
                with EngineClient(t.address) as c:
                    with contextlib.suppress(EngineRpcError):
                        if c.health(timeout=2.0) == "SERVING":
                            return
            else:
                with urllib.request.urlopen(t.address + "/v1/models", timeout=2.0) as resp:
                    t.model = json.loads(resp.read())["data"][0]["id"]
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{t.name} at {t.address} did not become ready within {timeout:.0f}s")


def _launch_commands(args: argparse.Namespace, model_path: Path) -> list[tuple[str, str, bool, list[str], str]]:
    """(name, kind, is_peer, command, address) of each server this run starts itself."""
    py, out = sys.executable, []
    for kind in args.launch:
        port = _free_port()
        sub = ["-m", "sluice.http_facade.cli", "serve"] if kind == "http" else ["-m", "sluice.engine.cli", "engine"]
        cmd = [py, *sub, args.model, "--device", "cpu", "--mode", "server", "--overrides", args.sluice_overrides,
               "--port", str(port)]
        if args.sluice_speculative_mode:
            cmd += ["--speculative-mode", args.sluice_speculative_mode]
        addr = f"http://127.0.0.1:{port}" if kind == "http" else f"127.0.0.1:{port}"
        out.append((f"sluice-{kind}", "openai" if kind == "http" else "grpc", False, cmd, addr))
    if args.peer == "llamacpp":
        port = _free_port()
        # One model, requests served one at a time behind its lock: never interrupt a stream for a
        # newer request (the server's default would), and skip all-token logits it does not need.
        threads = str(args.threads)
        cmd = [py, "-m", "llama_cpp.server", "--model", str(model_path), "--host", "127.0.0.1", "--port", str(port),
               "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", str(args.peer_ctx),
               "--interrupt_requests", "False", "--logits_all", "False"]
        out.append(("llamacpp", "openai", True, cmd, f"http://127.0.0.1:{port}"))
    if args.peer == "llama-server":
        port = _free_port()
        # The C++ server with continuous batching over --parallel slots; the context (-c) is split
        # evenly among the slots.
        threads = str(args.threads)
        cmd = [args.llama_server, "-m", str(model_path), "--host", "127.0.0.1", "--port", str(port),
               "-t", threads, "-tb", threads, "-c", str(args.peer_ctx), "--parallel", str(args.peer_slots),
               "--no-webui"]
        out.append(("llama-server", "openai", True, cmd, f"http://127.0.0.1:{port}"))
    return out


def llamacpp_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


@contextlib.contextmanager
def open_targets(args: argparse.Namespace):
    """The targets of this run, ready; servers started here are stopped on exit."""
    targets = [Target(args.url_name, "openai", args.url.rstrip("/"))] if args.url else []
    if args.grpc:
        targets.append(Target("sluice-grpc", "grpc", args.grpc))
    if args.peer_url:
        targets.append(Target("peer", "openai", args.peer_url.rstrip("/"), is_peer=True))
    if args.peer == "llama-server" and not (args.llama_server and Path(args.llama_server).is_file()):
        print("llama.cpp peer: no llama-server binary (build it as bench/README.md shows and pass "
              "--llama-server PATH); skipping the llama-server row", flush=True)
        args.peer = None
    if args.peer == "llamacpp" and not llamacpp_available():
        print("llama.cpp peer: llama-cpp-python is not installed (pip install 'llama-cpp-python[server]'); "
              "skipping the llamacpp row", flush=True)
        args.peer = None
    from sluice.engine.loaders import resolve_path
    logdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    model_path = resolve_path(args.model)
    try:
        for t in targets:
            _wait_ready(t)
        # One at a time, so that each load has the machine (and, with --cold, the disk) to itself.
        for name, kind, is_peer, cmd, addr in _launch_commands(args, model_path):
            if args.cold:
                evict_from_page_cache(model_path)
            t0 = time.monotonic()
            proc, log_path = _spawn(name, cmd, logdir, args.threads)
            t = Target(name, kind, addr, is_peer, proc=proc, log_path=log_path)
            targets.append(t)
            _wait_ready(t)
            t.ready_s = time.monotonic() - t0
            print(f"{name} ready in {t.ready_s:.1f} s", flush=True)
        yield targets
    finally:
        for t in targets:
            if t.proc is not None:
                _stop(t.proc)
        shutil.rmtree(logdir, ignore_errors=True)   # a server that failed to start had its log's tail printed


# ------------------------------------------------------------------------------ load drivers
async def run_load(send, items: list[Item], concurrency: int | None, rate: float | None,
                   seed: int) -> tuple[list[Record], float]:
    """Fixed concurrency (``concurrency`` workers) or Poisson arrivals at ``rate`` requests/s."""
    t0 = time.perf_counter()
    if concurrency is not None:
        queue = list(reversed(items))
        records: list[Record] = []

        async def worker():
            while queue:
                records.append(await send(queue.pop()))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(items)))))
    else:
        rng = np.random.default_rng(seed)
        tasks = []
        for item in items:
            tasks.append(asyncio.create_task(send(item)))
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


# ------------------------------------------------------------------------------ metrics
def _stats(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99")}
    ms = np.asarray(values_s) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def _meets(r: Record, slo: dict[str, float | None]) -> bool:
    tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    checks = ((slo.get("ttft_ms"), r.ttft), (slo.get("tpot_ms"), tpot), (slo.get("e2e_ms"), r.e2e))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def summarize(records: list[Record], duration: float, slo: dict[str, float | None]) -> dict:
    ok = [r for r in records if r.ok]
    good = [r for r in ok if _meets(r, slo)]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": duration,
        "mean_prompt_tokens": (float(np.mean([r.prompt_tokens for r in ok]))
                               if ok and all(r.usage_source == "usage" for r in ok) else float("nan")),
        "output_count_source": sorted({r.usage_source for r in ok}),
        "mean_output_tokens": out_tokens / len(ok) if ok else float("nan"),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "goodput_req_s": len(good) / duration,
        "goodput_tok_s": sum(r.output_tokens for r in good) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl), "e2e_ms": _stats([r.e2e for r in ok]),
    }


# ------------------------------------------------------------------------------ report
_COLS = ("target", "load", "ok", "req/s", "out tok/s", "good req/s", "TTFT p50", "TTFT p90", "TTFT p99",
         "TPOT mean", "TPOT p90", "ITL p90", "E2E p50", "E2E p90")


def _row(name: str, load: str, m: dict) -> tuple:
    return (name, load, f"{m['completed']}/{m['completed'] + m['failed']}", f"{m['request_throughput']:.2f}",
            f"{m['output_throughput']:.1f}", f"{m['goodput_req_s']:.2f}", *(f"{m[k][p]:.0f}" for k, p in (
                ("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("tpot_ms", "mean"),
                ("tpot_ms", "p90"), ("itl_ms", "p90"), ("e2e_ms", "p50"), ("e2e_ms", "p90"))))


def ratios(results: list[dict], ours: str, peer: str) -> list[dict]:
    """Per load point: our output tokens/s and p90 TTFT as multiples of the peer's."""
    by = {(r["target"], r["load"]): r["metrics"] for r in results}
    out = []
    for (name, load), m in by.items():
        p = by.get((peer, load))
        if name != ours or p is None or not p["output_throughput"]:
            continue
        out.append({"load": load, "ours": ours, "peer": peer,
                    "output_throughput_ratio": m["output_throughput"] / p["output_throughput"],
                    "ttft_p90_ratio": m["ttft_ms"]["p90"] / p["ttft_ms"]["p90"],
                    "tpot_mean_ratio": m["tpot_ms"]["mean"] / p["tpot_ms"]["mean"]})
    return out


def print_report(results: list[dict], ratio_rows: list[dict], baseline: dict | None) -> None:
    rows = [_COLS] + [_row(r["target"], r["load"], r["metrics"]) for r in results]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_COLS))]
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
    print("(latencies in ms)")
    for r in results:
        if r["metrics"]["errors"]:
            print(f"{r['target']} @ {r['load']}: errors: {r['metrics']['errors']}")
    for q in ratio_rows:
        print(f"{q['ours']} / {q['peer']} @ {q['load']}: output tok/s x{q['output_throughput_ratio']:.2f}, "
              f"TTFT p90 x{q['ttft_p90_ratio']:.2f}, TPOT mean x{q['tpot_mean_ratio']:.2f}")
    if baseline:
        print(f"transformers sequential: {baseline['output_tok_s']:.1f} output tok/s "
              f"({baseline['requests']} requests one after another)")
        for r in results:
            print(f"{r['target']} @ {r['load']}: x{r['metrics']['output_throughput'] / baseline['output_tok_s']:.2f} "
                  f"transformers sequential")


def plot(results: list[dict], outdir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    names = sorted({r["target"] for r in results})
    charts = {"latency.png": [("ttft_ms", "p90", "TTFT p90 (ms)"), ("tpot_ms", "mean", "TPOT mean (ms)")],
              "throughput.png": [("output_throughput", None, "output tokens/s"),
                                 ("request_throughput", None, "requests/s")]}
    paths = []
    for fname, panels in charts.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
        for ax, (key, sub, label) in zip(axes, panels):
            for name in names:
                pts = [r for r in results if r["target"] == name]
                ax.plot([r["load_value"] for r in pts],
                        [r["metrics"][key][sub] if sub else r["metrics"][key] for r in pts], marker="o", label=name)
            ax.set_xlabel(results[0]["load_kind"])
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(outdir / fname, dpi=120)
        plt.close(fig)
        paths.append(outdir / fname)
    return paths


# ------------------------------------------------------------------------------ main
def _numbers(text: str, kind):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("targets (at least one)")
    g.add_argument("--url", help="a running sluice facade (OpenAI API), e.g. http://127.0.0.1:8000")
    g.add_argument("--url-name", default="sluice-http",
                   help="its name in the report (default: %(default)s; another, e.g. sluice-base, to measure it "
                        "beside a sluice this run launches)")
    g.add_argument("--grpc", help="a running sluice engine's gRPC address, e.g. 127.0.0.1:50051")
    g.add_argument("--launch", action="append", choices=("http", "grpc"), default=[],
                   help="start sluice itself: http = `sluice serve` (facade+engine), grpc = `sluice engine`")
    g.add_argument("--sluice-overrides", default="max_num_sequence=32;max_total_seq_length=16384",
                   help="--overrides for a launched sluice (default: %(default)s)")
    g.add_argument("--sluice-speculative-mode", metavar="MODE",
                   help="--speculative-mode for a launched sluice (ngram, eagle, ...; default: the server's)")
    g.add_argument("--peer", choices=("llamacpp", "llama-server"),
                   help="start a llama.cpp peer on the GGUF: llama-cpp-python's server (one request at a time) "
                        "or the C++ llama-server with --peer-slots parallel slots")
    g.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                   help="path of the llama-server binary (default: $LLAMA_SERVER)")
    g.add_argument("--peer-slots", type=int, default=32, help="llama-server --parallel (default: %(default)s)")
    g.add_argument("--peer-url", help="a running peer OpenAI-compatible server")
    g.add_argument("--peer-ctx", type=int, default=4096, help="llama.cpp context tokens (default: %(default)s)")
    ap.add_argument("--model", default="smollm2", help="model short name or GGUF path (tokenizer, launches)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1),
                    help="CPU threads of every server this run starts (default: $OMP_NUM_THREADS or all cores)")
    ap.add_argument("--dataset", choices=("synthetic", "conversations", "grounded", "open"), default="synthetic",
                    help="synthetic word prompts, the conversation set, or bench/prompts.py's chats")
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="send the same prompts at every load point (measures prefix-cache reuse across them)")
    ap.add_argument("--prompt-format", choices=("text", "ids"), default="text")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each load point this many times per target, the targets taking turns round by "
                         "round, each round with --num-prompts prompts of its own; the metrics are over all "
                         "rounds (on a host whose speed drifts, the servers then share its slow and fast minutes)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=None,
                    help="synthetic default 64 (exact); caps the chats (grounded/open default 128)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=lambda s: _numbers(s, int), help="e.g. 1,8,32 (default: 8)")
    load.add_argument("--request-rate", type=lambda s: _numbers(s, float), help="Poisson arrivals/s, e.g. 1,2,4")
    ap.add_argument("--slo-ttft-ms", type=float)
    ap.add_argument("--slo-tpot-ms", type=float)
    ap.add_argument("--slo-e2e-ms", type=float)
    ap.add_argument("--hf-baseline", type=int, default=0, metavar="N",
                    help="also time transformers generate on the first N prompts, one after another")
    ap.add_argument("--cold", action="store_true",
                    help="evict the model file from the page cache before starting each server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, metavar="DIR", help="write latency.png and throughput.png here")
    return ap


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.url or args.grpc or args.launch or args.peer or args.peer_url):
        ap.error("give a target: --url, --grpc, --launch, --peer or --peer-url")
    for name in ("num_prompts", "rounds", "input_len", "output_len", "peer_ctx", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')}: must be a positive integer, got {value}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            raise SystemExit(2) from None


def _items(args: argparse.Namespace, tok, num_loads: int) -> tuple[list[Item], list[list[Item]]]:
    """The warm-up's requests, and each load point's own (the same ones with ``--repeat-prompts``)."""
    n, fresh = args.num_prompts, not args.repeat_prompts
    warmup = synthetic_items(tok, 2, args.input_len, 8, args.seed + 10_000)
    if args.dataset in ("grounded", "open"):
        prompts = GROUNDED if args.dataset == "grounded" else OPEN
        return warmup, [chat_items(prompts, n, args.output_len or 128, i * n if fresh else 0) for i in range(num_loads)]
    if args.dataset == "conversations":
        return warmup, [conversation_items(CONVERSATIONS, n, args.output_len)] * num_loads
    if not fresh:
        return warmup, [synthetic_items(tok, n, args.input_len, args.output_len or 64, args.seed)] * num_loads
    return warmup, [synthetic_items(tok, n, args.input_len, args.output_len or 64, args.seed + i)
                    for i in range(num_loads)]


async def _measure(targets: list[Target], warmup: list[Item], loads: list[list[Item]], args,
                   stop_ids: list[int]) -> list[dict]:
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "e2e_ms": args.slo_e2e_ms}
    kind, values = ("concurrency", args.concurrency) if args.request_rate is None else ("request_rate", args.request_rate)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A fresh connection per request: llama-server drops idle keep-alive connections, and a
    # request written into one that is closing fails ("Can not write request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    results, clients = [], []
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sends = {t.name: t.sender(session, args.prompt_format, stop_ids, clients) for t in targets}
        for name, send in sends.items():   # warm-up: not measured
            await asyncio.gather(*(send(it) for it in warmup))
        # Interleave the targets at each load point (round by round with --rounds), so drift on a
        # shared machine hits them alike. loads holds each load point's rounds in turn.
        rounds = args.rounds
        for i, value in enumerate(values):
            conc, rate = (value, None) if kind == "concurrency" else (None, value)
            label = f"c={value}" if conc else f"rate={value}"
            records: dict[str, list[Record]] = {t.name: [] for t in targets}
            duration = dict.fromkeys(records, 0.0)
            for r in range(rounds):
                for t in targets:
                    recs, seconds = await run_load(sends[t.name], loads[i * rounds + r], conc, rate, args.seed + r)
                    records[t.name] += recs
                    duration[t.name] += seconds
                    if rounds > 1:
                        done = sum(x.output_tokens for x in recs if x.ok)
                        print(f"  {t.name} {label} round {r + 1}/{rounds}: {done / seconds:.1f} out tok/s", flush=True)
            for t in targets:
                results.append({"target": t.name, "load": label, "load_kind": kind, "load_value": value,
                                "metrics": summarize(records[t.name], duration[t.name], slo)})
                print(f"  {t.name} {label}: {results[-1]['metrics']['output_throughput']:.1f} out tok/s", flush=True)
    for client in clients:
        await client.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [8]
    tok = _load_tokenizer(args.model)
    warmup, loads = _items(args, tok, len(args.concurrency or args.request_rate) * args.rounds)
    stop_ids = sorted(tok.eos_token_ids)
    baseline = None
    if args.hf_baseline:   # before any server starts, so it has the CPU to itself
        from offline import hf_sequential
        baseline = hf_sequential(args.model, tok, loads[0][:args.hf_baseline])
    with open_targets(args) as targets:
        results = asyncio.run(_measure(targets, warmup, loads, args, stop_ids))
        servers = {t.name: {"ready_s": t.ready_s, **tree_memory(t.proc.pid)} for t in targets if t.proc is not None}
    peer = next((t.name for t in targets if t.is_peer), None)
    ratio_rows = [row for t in targets if peer and not t.is_peer for row in ratios(results, t.name, peer)]
    print_report(results, ratio_rows, baseline)
    for name, m in servers.items():
        print(f"{name}: ready in {m['ready_s']:.1f} s{' (cold page cache)' if args.cold else ''}, "
              f"RSS {m['rss_mib']:.0f} MiB (peak <= {m['peak_rss_mib']:.0f} MiB) over {m['processes']} processes")
    if args.plot:
        print("charts:", ", ".join(str(p) for p in plot(results, args.plot)))
    if args.json:
        from bandwidth import machine
        args.json.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "ratios": ratio_rows, "servers": servers,
                                         "transformers": baseline},
                                        indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
