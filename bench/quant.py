"""Weight formats (``quantization``) side by side on one model, each in its own process.

    python bench/quant.py                                  # SmolLM2-135M GGUF, none,bf16,int8,int4
    python bench/quant.py --formats none,int4 --tokens 64 --json out.json
    python bench/quant.py --model /path/to/folder --quick  # plumbing only (seconds)

Per format, in a fresh process (so that the resident memory is that format's alone):
* ``rss_load_mib``: VmRSS after ``load_model`` (weights, tokenizer, interpreter), its peak
  during the load (VmHWM), and ``weights_mib``, the bytes of the weights as held;
* memory of a serving engine: ``rss_served_mib``, VmRSS of the engine (a 64 MiB KV pool) after
  every run below, idle, split into ``rss_runtime_mib`` (the interpreter, torch, sluice's modules
  and its C++ kernels' library: code, measured before the load) and the rest: the model, the
  tokenizer and the engine with its KV pool (``kv_pool_mib``, the caches' own bytes), set against
  issue #13's goal, at most 1.5x the model file plus the KV pool;
* ``decode_tok_s``: single-stream greedy decode (EOS ignored), tokens after the first ÷ time
  after the first, from a short prompt;
* ``prefill_tok_s``: a ``--prefill-len``-token prompt's tokens ÷ its time to first token;
* ``batch8_tok_s``: 8 short prompts at once, generated tokens ÷ wall time (prefill included);
* ``profile_ms``: one decode step split by manual timers around the model's parts: projections
  (every ``_Linear``), the LM head, attention (the backend's forward), sampling, the rest of the
  forward (embedding, norms, RoPE, residuals) and what the step spends outside the runner (the
  scheduler, detokenizer, Python).

Ratios are against ``none`` measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timers import StepTimers, TimedForward  # noqa: E402

KV_POOL_MIB = 64
FORMATS = ("none", "bf16", "int8", "int4", "w8a8", "w4a8")
FILLER = ("the river carried stone and sand past the old mill while the village slept and the lamps of the "
          "harbour burned low over boats that waited for morning tide").split()


def _rss_mib(field: str = "VmRSS") -> float:
    """Resident memory (``VmRSS``) or its peak so far (``VmHWM``) of this process, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _weight_bytes(model) -> int:
    """Bytes of the weights as the model holds them (float parameters, packed and quantized ones)."""
    from sluice.engine.models.llama import _Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, _Linear) and module.quantized is not None:
            total += module.quantized.nbytes
        elif isinstance(module, _Linear) and module.packed is not None:
            total += module.packed.to_dense().nbytes
    for held in (model.quant_lm_head, model.quant_embedding):
        total += held.nbytes if held is not None else 0
    if model._packed_lm_head is not None:
        total += model._packed_lm_head.to_dense().nbytes
    return total


def _profile(llm, tok, steps: int) -> dict:
    """Mean ms per decode step by part, over ``steps`` single-stream decode steps."""
    from sluice.engine.models.llama import _Linear
    from sluice.engine.sampling_params import SamplingParams

    engine = llm.engine
    runner, model = engine.runner, engine.runner.model
    timers = StepTimers()
    for module in model.modules():
        if isinstance(module, _Linear):
            timers.wrap(module, "forward", "projections")
    timers.wrap(runner.attn, "forward", "attention")
    if model._cpu_decoder() is not None:
        # w4a8 / w8a8: every layer runs inside one C++ call (kernels/cpu_ops.cpp), which the
        # Python timers cannot split; it is reported whole as "layers in C++".
        model._decoder = TimedForward(model._decoder, timers, "layers_cpp")
    timers.wrap(model, "compute_logits", "lm_head")
    timers.wrap(runner, "forward", "model_forward")
    timers.wrap(runner.sampler, "penalize", "sampling")
    timers.wrap(runner.sampler, "draw", "sampling")
    timers.wrap(runner, "execute", "runner")
    ids = tok.encode(" ".join(FILLER[:12]), add_special_tokens=False)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_request("profile", ids, params)
    for _ in range(4):          # prefill and warm-up steps, not timed
        engine.step()
    timers.active = True
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t0
    timers.active = False
    while engine.has_unfinished_requests():
        engine.step()
    if isinstance(model._decoder, TimedForward):
        model._decoder = model._decoder._inner
    t = defaultdict(float, {k: v * 1000 / steps for k, v in timers.total.items()})
    return {
        "step": wall * 1000 / steps,
        "projections": t["projections"],
        "attention": t["attention"],
        "layers_cpp": t["layers_cpp"],
        "lm_head": t["lm_head"],
        "sampling": t["sampling"],
        "rest_of_forward": t["model_forward"] - t["projections"] - t["attention"] - t["layers_cpp"],
        "runner_other": t["runner"] - t["model_forward"] - t["lm_head"] - t["sampling"],
        "outside_runner": wall * 1000 / steps - t["runner"],
    }


def run_one(fmt: str, args) -> dict:
    from sluice.engine.llm import LLM
    from sluice.engine.loaders import load_model
    from sluice.engine.loaders import resolve_path
    from sluice.engine.sampling_params import SamplingParams
    from sluice.kernels import cpu_ext

    if fmt in ("auto", "w4a8", "w8a8") and cpu_ext.available():
        cpu_ext.module()                    # the kernels' library is code: part of the runtime
    runtime = _rss_mib()
    path = resolve_path(args.model)
    file_bytes = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype="float32", device="cpu", quantization=fmt)
    out = {"format": loaded.quantization, "load_s": time.perf_counter() - t0,
           "rss_runtime_mib": runtime, "file_mib": file_bytes / 2**20,
           "rss_load_mib": _rss_mib(), "peak_load_mib": _rss_mib("VmHWM"), "weights_mib": _weight_bytes(loaded.model) / 2**20}
    llm = LLM(args.model, loaded=loaded, device="cpu", quantization=loaded.quantization,
              kv_cache_memory_bytes=KV_POOL_MIB << 20, max_num_seqs=8)
    out["rss_engine_mib"] = _rss_mib()
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate("Warm up the kernels with a short prompt.", SamplingParams(max_tokens=4, temperature=0.0))
    rates = []
    for i in range(args.repeats):
        t_first, n = None, 0
        for delta in llm.generate_stream(f"Write a story about a lighthouse keeper (take {i}).", params):
            n += sum(len(d.token_ids) for d in delta.deltas)
            if t_first is None and n:
                t_first = time.perf_counter()
        rates.append((n - 1) / (time.perf_counter() - t_first))
    out["decode_tok_s"] = statistics.median(rates)
    words = (FILLER * (args.prefill_len // len(FILLER) + 2))
    ids = tok.encode(" ".join(words), add_special_tokens=False)[:args.prefill_len]
    t0 = time.perf_counter()
    llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
    out["prefill_tok_s"] = len(ids) / (time.perf_counter() - t0)
    batch = [f"Describe a harbour town in winter, version {i}." for i in range(8)]
    t0 = time.perf_counter()
    res = llm.generate(batch, params)
    out["batch8_tok_s"] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0)
    out["profile_ms"] = _profile(llm, tok, args.profile_steps)
    out["rss_served_mib"] = _rss_mib()
    out["kv_pool_mib"] = sum(t.nbytes for kv in llm.engine.runner.kv_caches for t in kv) / 2**20
    return out


def _table(results: list[dict]) -> str:
    base = next((r for r in results if r["format"] == "none"), results[0])
    head = "| format | weights MiB | RSS after load MiB | peak MiB | decode tok/s | x none | prefill tok/s | x none | batch-8 tok/s | x none |"
    rows = [head, "|" + " --- |" * 10]
    for r in results:
        rows.append(f"| {r['format']} | {r['weights_mib']:.0f} | {r['rss_load_mib']:.0f} | {r['peak_load_mib']:.0f} | {r['decode_tok_s']:.1f} | "
                    f"{r['decode_tok_s'] / base['decode_tok_s']:.2f} | {r['prefill_tok_s']:.0f} | "
                    f"{r['prefill_tok_s'] / base['prefill_tok_s']:.2f} | {r['batch8_tok_s']:.1f} | "
                    f"{r['batch8_tok_s'] / base['batch8_tok_s']:.2f} |")
    rows += ["", "| format | engine RSS MiB | runtime MiB | the rest MiB | KV pool MiB | (rest - KV) ÷ file | goal: rest ≤ 1.5 × file + KV |",
             "|" + " --- |" * 7]
    for r in results:
        rest = r["rss_served_mib"] - r["rss_runtime_mib"]
        goal = 1.5 * r["file_mib"] + r["kv_pool_mib"]
        rows.append(f"| {r['format']} | {r['rss_served_mib']:.0f} | {r['rss_runtime_mib']:.0f} | {rest:.0f} | "
                    f"{r['kv_pool_mib']:.0f} | {(rest - r['kv_pool_mib']) / r['file_mib']:.2f} | "
                    f"{goal:.0f} MiB: {'met' if rest <= goal else 'missed'} |")
    parts = list(results[0]["profile_ms"])
    rows += ["", "| ms per decode step | " + " | ".join(parts) + " |", "|" + " --- |" * (len(parts) + 1)]
    for r in results:
        rows.append(f"| {r['format']} | " + " | ".join(f"{r['profile_ms'][p]:.2f}" for p in parts) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per decode run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="tiny settings: checks the plumbing, measures nothing")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)   # the child process: one format
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats, args.prefill_len, args.profile_steps = 8, 1, 16, 4
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return 0
    results = []
    for fmt in args.formats.split(","):
        child = [sys.executable, __file__, "--one", fmt, *(argv if argv is not None else sys.argv[1:])]
        proc = subprocess.run(child, capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{fmt}: {results[-1]['decode_tok_s']:.1f} decode tok/s", file=sys.stderr, flush=True)
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "SLUICE_NUM_THREADS")}
    print(f"model {args.model}; threads {threads}")
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": threads, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
