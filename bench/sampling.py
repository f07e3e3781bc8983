"""Sampling's cost in a decode step: ms per step with N streams decoding at once, greedy against
each sampling setting, in one process (the ratio to greedy is the sampler's share).

    python bench/sampling.py                         # SmolLM2 (default format), 32 streams
    python bench/sampling.py --streams 8 --json out.json
    python bench/sampling.py --model /path/to/tiny --quick    # plumbing only

Each setting decodes ``--streams`` requests (EOS ignored) for ``--steps`` measured steps after
the prefill and a few warm-up steps; settings alternate over ``--repeats`` rounds and the median
is reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T=1.0": {"temperature": 1.0},
    "T=0.7, top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=0.8, top_k=40": {"temperature": 0.8, "top_k": 40},
    "T=1.0, min_p=0.05": {"temperature": 1.0, "min_p": 0.05},
}


def step_ms(llm, streams: int, steps: int, params: dict, tag: str) -> float:
    from sluice.engine.sampling_params import SamplingParams

    core = llm.engine
    sp = SamplingParams(max_tokens=steps + 8, ignore_eos=True, **params)
    for i in range(streams):
        core.add_request(f"{tag}-{i}", f"Tell me about topic number {i} in some detail.", sp)
    running = core.scheduler.running
    while len(running) < streams or not all(r.output_token_ids for r in running):
        core.step()                                   # the prefill, until every stream decodes
    for _ in range(3):
        core.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    ms = (time.perf_counter() - t0) * 1000 / steps
    while core.has_unfinished_requests():
        core.step()
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks the plumbing, measures nothing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.streams, args.steps, args.repeats = 4, 3, 1
    from sluice.engine.llm import LLM

    llm = LLM(args.model, kv_cache_memory_bytes=256 << 20, max_num_seqs=max(args.streams, 1))
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(args.repeats):
        for name, params in SETTINGS.items():
            times[name].append(step_ms(llm, args.streams, args.steps, params, f"{r}-{name}"))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"model {args.model} ({llm.engine.loaded.quantization}), {args.streams} streams, ms per decode step")
    print("| sampling | ms per step | × greedy |")
    print("| --- | ---: | ---: |")
    for name, ms in med.items():
        print(f"| {name} | {ms:.1f} | {ms / med['greedy']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"streams": args.streams, "ms_per_step": med, "runs": times}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
