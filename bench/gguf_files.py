"""GGUF files side by side in sluice, each in its own process (``quantization=auto``): load time,
memory, single-stream decode, prefill and 8 streams; ratios against the first file of the run.

    python bench/make_1b_gguf.py out/Q4_1.gguf --type Q4_1       # and Q4_K_M, Q5_K_M, Q6_K, Q8_0
    python bench/gguf_files.py out/Q4_1.gguf out/Q4_K_M.gguf out/Q6_K.gguf

Per file: the format ``auto`` picked; ``load_s`` (``load_model``, page cache warm after the
first file's run); VmRSS after the load and its peak during it (VmHWM: the mapped file's pages
count while they are read); ``decode_tok_s``: greedy single stream, the best of --repeats runs of
the per-token time between an 18- and a 2-token generation (the host is shared: the best run is
the least disturbed one); ``prefill_tok_s``: a 256-token prompt's tokens ÷ its best time;
``batch8_tok_s``: 8 prompts of 16 tokens at once, 32 tokens each, tokens ÷ best wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _vm(key: str) -> float:
    return int(Path("/proc/self/status").read_text().split(f"{key}:")[1].split()[0]) / 1024


def one(path: str, repeats: int, threads: int) -> dict:
    import torch

    from sluice.engine.llm import LLM
    from sluice.engine.loaders import load_model
    from sluice.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    loaded = load_model(path, dtype="float32", quantization="auto")
    load_s = time.perf_counter() - t0
    rss, peak = _vm("VmRSS"), _vm("VmHWM")
    llm = LLM(loaded=loaded, quantization=loaded.quantization, kv_cache_memory_bytes=128 << 20)

    def best(prompts, params) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate(prompts, params)
            times.append(time.perf_counter() - t)
        return min(times)

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)   # noqa: E731
    prompt = [1, *range(1000, 1015)]
    per_token = (best([prompt], greedy(18)) - best([prompt], greedy(2))) / 16
    long = [1, *range(2000, 2255)]
    prefill = best([long], greedy(1))
    batch = best([[1, *range(3000 + 20 * i, 3015 + 20 * i)] for i in range(8)], greedy(32))
    return {"file": os.path.basename(path), "mib": os.path.getsize(path) / 2 ** 20, "format": loaded.quantization,
            "load_s": load_s, "rss_mib": rss, "peak_mib": peak, "decode_tok_s": 1 / per_token,
            "prefill_tok_s": 256 / prefill, "batch8_tok_s": 8 * 32 / batch}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # the child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.files[0], args.repeats, args.threads)))
        return
    rows = []
    for path in args.files:
        proc = subprocess.run([sys.executable, __file__, "--one", path, "--repeats", str(args.repeats),
                               "--threads", str(args.threads)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{path}: {proc.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{args.threads} threads; ratios (x) against {base['file']}")
    print("| file | MiB | format | load s | RSS after load MiB | peak MiB | decode tok/s | prefill tok/s | 8 streams tok/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = lambda key: f"{r[key]:.1f} ({r[key] / base[key]:.2f})"   # noqa: E731
        print(f"| {r['file']} | {r['mib']:.0f} | {r['format']} | {r['load_s']:.1f} | {r['rss_mib']:.0f} | "
              f"{r['peak_mib']:.0f} | {ratio('decode_tok_s')} | {ratio('prefill_tok_s')} | {ratio('batch8_tok_s')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
