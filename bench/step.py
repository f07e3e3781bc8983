"""Where one decode step's time goes, phase by phase, with N streams decoding at once.

    python bench/step.py                                  # SmolLM2 (default format): 1 and 32 streams
    python bench/step.py --streams 8 --penalties --json out.json
    python bench/step.py --model /path/to/tiny --quick    # plumbing only

Every phase is timed by a wall-clock wrapper around the function that does it (no profiler, so
Python is not slowed): the scheduler, building the step's input tensors, the model's layers
(the C++ layer stack when the format has one, else the Python forward), the Python around them
(embedding, RoPE, the call itself), the LM head, building the sampling batch, the sampler, and
the engine's output processing (detokenizer, stop strings, deltas). "other" is the step's wall
time minus all of these. The wrappers' own cost, ~1 µs each, is inside the phases.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timers import StepTimers, TimedForward  # noqa: E402

PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}
PHASES = ("schedule", "inputs", "layers", "forward_python", "lm_head", "sampling_batch", "sampler",
          "sample_other", "outputs", "other")


def instrument(core) -> StepTimers:
    from sluice.engine.sampler import SamplingBatch

    timers = StepTimers()
    runner, model = core.runner, core.loaded.model
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "outputs")
    if hasattr(core, "outputs"):   # the output processor (before it, the core's own methods)
        timers.wrap(core.outputs, "process", "outputs")
        timers.wrap(core.outputs, "collect", "outputs")
    else:
        timers.wrap(core, "_process", "outputs")
        timers.wrap(core, "_collect", "outputs")
    timers.wrap(runner, "prepare", "inputs")
    timers.wrap(runner, "forward", "forward")            # split below into layers + Python
    timers.wrap(runner, "sample", "sample")              # split into LM head, batch, sampler, rest
    timers.wrap(model, "compute_logits", "lm_head")
    timers.wrap(SamplingBatch, "from_rows", "sampling_batch")
    # The sampler's two stages (the runner calls them apart: verification replaces the draw).
    timers.wrap(runner.sampler, "penalize", "sampler")
    timers.wrap(runner.sampler, "draw", "sampler")
    if model._cpu_decoder() is not None:
        model._decoder = TimedForward(model._decoder, timers, "layers")
    else:   # the Python layers: each layer's forward counts as "layers"
        for layer in model.layers:
            timers.wrap(layer, "forward", "layers")
    return timers


def _prompt(i: int, context: int) -> str:
    ask = f"Tell me about topic number {i} in some detail."
    if not context:
        return ask
    # ~10 tokens a sentence; each stream's filler differs, so no prefix is shared.
    filler = " ".join(f"Note {i}.{j}: the river rose by {j % 7} feet at mile {3 * j + i}." for j in range(context // 16))
    return filler + "\n" + ask


def measure(core, timers: StepTimers, streams: int, steps: int, params: dict, tag: str, context: int = 0) -> dict:
    from sluice.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=steps + 16, ignore_eos=True, **params)
    for i in range(streams):
        core.add_request(f"{tag}-{i}", _prompt(i, context), sp)
    running = core.scheduler.running
    while len(running) < streams or not all(r.output_token_ids for r in running):
        core.step()                                   # the prefill, until every stream decodes
    for _ in range(5):
        core.step()
    timers.total.clear()
    timers.active = True
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - t0) * 1000 / steps
    timers.active = False
    ms = {k: v * 1000 / steps for k, v in timers.total.items()}
    while core.has_unfinished_requests():
        core.step()
    out = {
        "schedule": ms.get("schedule", 0.0),
        "inputs": ms.get("inputs", 0.0),
        "layers": ms.get("layers", 0.0),
        "forward_python": ms.get("forward", 0.0) - ms.get("layers", 0.0),
        "lm_head": ms.get("lm_head", 0.0),
        "sampling_batch": ms.get("sampling_batch", 0.0),
        "sampler": ms.get("sampler", 0.0),
        "sample_other": ms.get("sample", 0.0) - ms.get("lm_head", 0.0) - ms.get("sampling_batch", 0.0)
        - ms.get("sampler", 0.0),
        "outputs": ms.get("outputs", 0.0),
    }
    out["other"] = wall - sum(out.values())
    out["step"] = wall
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", default="1,32", help="comma-separated stream counts")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--penalties", action="store_true", help=f"every request also sets {PENALTIES}")
    ap.add_argument("--context", type=int, default=0, help="about this many prompt tokens per stream")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16"))
    ap.add_argument("--quantization", default=None, help="the weight format (default: the model's auto)")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks the plumbing, measures nothing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    if args.quick:
        streams, args.steps, args.repeats = [2], 3, 1
    from sluice.engine.llm import LLM

    kv = max(256 << 20, max(streams) * (args.context + args.steps + 64) * 64 << 10)   # SmolLM2: ~45 KiB a token
    extra = {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization:
        extra["quantization"] = args.quantization
    llm = LLM(args.model, kv_cache_memory_bytes=kv, max_num_seqs=max(streams), **extra)
    core = llm.engine
    timers = instrument(core)
    params = {"temperature": 0.0, **(PENALTIES if args.penalties else {})}
    results = {}
    for n in streams:
        runs = [measure(core, timers, n, args.steps, params, f"{r}-{n}", args.context) for r in range(args.repeats)]
        # The run with the median step time, so that the phases add up to its step.
        results[n] = sorted(runs, key=lambda r: r["step"])[len(runs) // 2]
        results[n]["step_runs"] = [r["step"] for r in runs]
    fmt = core.loaded.quantization
    print(f"model {args.model} ({fmt}), {'greedy with penalties' if args.penalties else 'greedy'}"
          f"{f', prompts of ~{args.context} tokens' if args.context else ''}, KV cache {getattr(core, 'kv_dtype', 'float32')}, ms per decode step (median of {args.repeats} runs of {args.steps} steps)")
    print("| phase | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in streams) + " |")
    print("| --- |" + " ---: |" * len(streams))
    for phase in (*PHASES, "step"):
        print(f"| {phase} | " + " | ".join(f"{results[n][phase]:.2f}" for n in streams) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "format": fmt, "penalties": args.penalties, "context": args.context,
            "kv_cache_dtype": str(getattr(core, "kv_dtype", "float32")),
            "ms": {str(n): r for n, r in results.items()}}, indent=2))
    spread = {n: statistics.pstdev(results[n]["step_runs"]) for n in streams}
    print("step time spread (pstdev, ms): " + ", ".join(f"{n}: {s:.2f}" for n, s in spread.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
