"""Replicas behind one facade: prefix-aware routing against round robin, and tensor parallelism's
communication cost per step.

Routing (``--routing-bench``, the default): for each replica count of ``--replicas`` and each
policy, ``sluice serve MODEL --data-parallel N --routing POLICY`` is started (each engine gets its
share of the cores), and the same shared-prefix workload is sent: ``--groups`` long system
prompts (``--prefix-words`` words each; documents people ask several questions about), each
followed by ``--questions`` distinct questions, in a shuffled order at ``--concurrency``. The KV
pool of each engine (``--kv-tokens``) is made too small to hold every group's prefix at once:
round robin sends every group to every engine, which then evicts and recomputes prefixes, while
prefix-aware routing keeps each group on the engine that holds it. Printed per point:
requests/s, mean and p90 TTFT, and the share of prompt tokens served from a prefix cache (the
servers' own ``usage.prompt_tokens_details.cached_tokens``); then, per replica count,
prefix-aware over round robin.

    python bench/replicas.py --model smollm2 --replicas 1,2,3 --json replicas.json

Tensor parallelism (``--tp-bench``): one 2-rank group over gloo, on this host's loopback, moving
what a step of the model's shape moves, and broadcasting the step's inputs; the time per step is
the communication a sharded step adds, for each split (``engine.parallel.tensor``): the exact one
(4 all-gathers per layer: each rank's half of the attention output, of the MLP activation and
twice of the hidden rows) and the row-parallel one (2 all-reduces of [rows, hidden] per layer).

    python bench/replicas.py --tp-bench --model smollm2 --rows 1,8,32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("harbour tide vessel anchor pilot cargo berth quay lighthouse current channel buoy rope hull "
         "keel rudder mast sail deck crew captain chart compass storm calm wave shore cliff reef bay").split()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(groups: int, questions: int, prefix_words: int, seed: int) -> list[tuple[int, list[dict]]]:
    rng = random.Random(seed)
    prefixes = [f"Document {g}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for g in range(groups)]
    items = [(g, [{"role": "system", "content": prefixes[g]},
                  {"role": "user", "content": f"Question {q} about document {g}: which word comes most often?"}])
             for g in range(groups) for q in range(questions)]
    rng.shuffle(items)
    return items


def start(model: str, replicas: int, policy: str, kv_tokens: int, threads: str | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if threads:
        env["OMP_NUM_THREADS"] = threads
    cmd = [sys.executable, "-m", "sluice.http_facade.cli", "serve", model, "--device", "cpu", "--port", str(port),
           "--data-parallel", str(replicas), "--routing", policy, "--embedding-model", "none", "--mode", "server",
           "--overrides", f"max_total_seq_length={kv_tokens};max_num_sequence=8"]
    log = open(f"/tmp/sluice-replicas-{port}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sluice serve exited: see {log.name}")
        if "ready on" in Path(log.name).read_text(errors="replace"):
            return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"sluice serve did not start: see {log.name}")


async def drive(url: str, model: str, items, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    records = []

    async def one(session, messages):
        async with sem:
            t0 = time.perf_counter()
            ttft = None
            usage = None
            async with session.post(url + "/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}) as resp:
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and ttft is None:
                        ttft = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
            records.append((ttft, time.perf_counter() - t0, usage))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        start_t = time.perf_counter()
        await asyncio.gather(*(one(session, m) for _, m in items))
        duration = time.perf_counter() - start_t
    ttfts = sorted(r[0] for r in records if r[0] is not None)
    prompt = sum(r[2]["prompt_tokens"] for r in records if r[2])
    cached = sum((r[2].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in records if r[2])
    return {"requests": len(records), "req_per_s": len(records) / duration,
            "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts), "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "cached_share": cached / prompt if prompt else 0.0, "duration_s": duration}


def routing_bench(args) -> list[dict]:
    items = workload(args.groups, args.questions, args.prefix_words, args.seed)
    results = []
    for n in [int(x) for x in args.replicas.split(",")]:
        for policy in (("prefix",) if n == 1 else ("prefix", "round_robin")):
            proc, url = start(args.model, n, policy, args.kv_tokens, args.threads)
            try:
                asyncio.run(drive(url, args.model, items[:4], 2, args.max_tokens))          # warm-up
                m = asyncio.run(drive(url, args.model, items, args.concurrency, args.max_tokens))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            m.update(replicas=n, policy=policy)
            results.append(m)
            print(f"replicas {n} {policy:12s} {m['req_per_s']:6.2f} req/s  TTFT mean {m['ttft_mean_ms']:7.0f} ms "
                  f"p90 {m['ttft_p90_ms']:7.0f} ms  cached {100 * m['cached_share']:5.1f}%", flush=True)
    for n in sorted({r["replicas"] for r in results if r["replicas"] > 1}):
        p = next(r for r in results if r["replicas"] == n and r["policy"] == "prefix")
        rr = next(r for r in results if r["replicas"] == n and r["policy"] == "round_robin")
        print(f"replicas {n}: prefix-aware / round robin: throughput {p['req_per_s'] / rr['req_per_s']:.2f}x, "
              f"mean TTFT {p['ttft_mean_ms'] / rr['ttft_mean_ms']:.2f}x")
    return results


def _tp_rank(rank: int, world: int, port: int, arch, rows_list: list[int], steps: int, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    widths = (arch.q_size // world, arch.intermediate_size // world, arch.hidden_size // world,
              arch.hidden_size // world)        # the exact split's pieces, per layer
    for rows in rows_list:
        x = torch.randn(rows, arch.hidden_size)
        pieces = [(torch.randn(rows, w), [torch.empty(rows, w) for _ in range(world)]) for w in widths]
        payload = [(torch.arange(rows), torch.arange(rows), {"slots": torch.arange(rows)})]

        def row_parallel():
            for _ in range(2 * arch.num_hidden_layers):
                dist.all_reduce(x)

        def exact():
            for _ in range(arch.num_hidden_layers):
                for mine, every in pieces:
                    dist.all_gather(every, mine)
                    torch.cat(every, 1)

        res[rows] = {}
        for name, collectives in (("exact", exact), ("row_parallel", row_parallel)):
            collectives()                # warm
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                dist.broadcast_object_list(payload, src=0)
                collectives()
            res[rows][name] = (time.perf_counter() - t0) / steps
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def tp_bench(args) -> dict:
    import multiprocessing as mp

    from sluice.engine.loaders import resolve_path

    path = resolve_path(args.model)
    if path.is_file():
        from sluice.engine.loaders.gguf_loader import load_gguf

        arch = load_gguf(path)[0]
    else:
        from sluice.engine.loaders.hf_loader import load_hf_folder

        arch = load_hf_folder(path)[0]
    rows = [int(r) for r in args.rows.split(",")]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, port, arch, rows, args.steps, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join(60)
    for r, s in res.items():
        print(f"tensor parallel, 2 ranks, {r} rows, {arch.num_hidden_layers} layers + the step broadcast: "
              f"exact split (4 all-gathers a layer) {1e3 * s['exact']:.2f} ms a step, row-parallel "
              f"(2 all-reduces of [{r}, {arch.hidden_size}] a layer) {1e3 * s['row_parallel']:.2f} ms")
    return {str(k): v for k, v in res.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--replicas", default="1,2,3")
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=400)
    p.add_argument("--kv-tokens", type=int, default=2048, help="each engine's KV pool (max_total_seq_length)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--threads", default=None, help="OMP_NUM_THREADS for the servers (default: their share)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-bench", action="store_true", help="measure tensor parallelism's communication instead")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = tp_bench(args) if args.tp_bench else routing_bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
