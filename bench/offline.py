"""Offline benchmarks of sluice's engine, each against a baseline measured in the same process,
printed as ratios.

    python bench/offline.py                      # SmolLM2-135M GGUF, every section
    python bench/offline.py --sections decode,prefix --json out.json
    python bench/offline.py --quick              # tiny smoke setting (seconds, not a measurement)

Sections:
* ``throughput``: engine vs transformers ``generate`` on the same weights (the GGUF dequantized to
  float32 by both), batch 1 (prompts one after another) and batched (all at once). Every run
  generates exactly ``--max-tokens`` tokens per prompt (EOS ignored) so the counts are equal.
* ``decode``: single-stream decode tokens/s (from the engine's own TTFT/total timings: tokens after
  the first ÷ time after the first) against transformers' and against the memory-bandwidth ceiling
  (distinct weight bytes ÷ read bandwidth, measured here with ``bench/bandwidth.py``).
* ``prefix``: TTFT of a request whose ``--prefix-len``-token prefix is already cached (hit) vs the
  same request on an engine with prefix caching off (miss).
* ``chunked``: one long prompt arriving while 4 streams decode, at several step token budgets
  (``max_num_batched_tokens``): the long prompt's TTFT, the decoders' worst step gap, tokens/s.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bandwidth import decode_ceiling, machine, measure_bandwidth, weight_bytes  # noqa: E402
from sluice.engine.llm import LLM  # noqa: E402
from sluice.engine.loaders import load_model, resolve_path  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402

SECTIONS = ("throughput", "decode", "prefix", "chunked")
BASE_PROMPTS = [
    "Explain how a river forms a delta.",
    "Write a short poem about the sea.",
    "List five uses of copper.",
    "What is the difference between weather and climate?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of a detective story in two sentences.",
]
FILLER = ("the river carried stone and sand past the old mill while the village slept and the lamps of the "
          "harbour burned low over boats that waited for morning tide").split()


def prompts(n: int) -> list[str]:
    return [BASE_PROMPTS[i % len(BASE_PROMPTS)] + f" (variant {i})" for i in range(n)]


def token_prompt(tok, length: int, seed: int) -> list[int]:
    """``length`` token ids of shuffled filler words (distinct per seed, so no accidental cache hits)."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < length:
        ids += tok.encode(" " + " ".join(rng.sample(FILLER, len(FILLER))), add_special_tokens=False)
    return ids[:length]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ----------------------------------------------------------------------------- transformers
def load_hf(model: str):
    from transformers import AutoModelForCausalLM

    path = resolve_path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_generate(hf, ids: list[int], max_new: int, exact: bool = True) -> int:
    """Greedy ``generate`` on one prompt; returns the number of new tokens."""
    t = torch.tensor([ids])                                           # [1, prompt_len]
    kw = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    if exact:
        kw["min_new_tokens"] = max_new
    with torch.inference_mode():
        out = hf.generate(t, attention_mask=torch.ones_like(t), **kw)  # [1, prompt_len + new]
    return out.shape[1] - t.shape[1]


def hf_sequential(model: str, tok, items) -> dict:
    """transformers ``generate`` over serving-bench items one after another (the serving baseline)."""
    hf = load_hf(model)
    encoded = [(list(it.token_ids) if it.token_ids else
                tok.encode(tok.apply_chat_template(list(it.messages)), add_special_tokens=False), it)
               for it in items]
    hf_generate(hf, encoded[0][0], 2)   # warm-up
    t0 = time.perf_counter()
    new = sum(hf_generate(hf, ids, it.max_tokens, it.exact) for ids, it in encoded)
    dt = time.perf_counter() - t0
    return {"requests": len(items), "output_tokens": new, "seconds": dt, "output_tok_s": new / dt}


def bench_hf(hf, texts: list[str], max_tokens: int, tok) -> dict[str, float]:
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)

    def batched():
        enc = [tok.encode(t) for t in texts]
        width = max(map(len, enc))
        ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])          # [B, width], left padded
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        return hf.generate(ids, attention_mask=mask, **kw)

    hf_generate(hf, tok.encode(texts[0]), 2)  # warm-up
    _, t_seq = timed(lambda: [hf_generate(hf, tok.encode(t), max_tokens) for t in texts])
    with torch.inference_mode():
        _, t_batch = timed(batched)
    n = len(texts) * max_tokens
    return {"batch1_tok_s": n / t_seq, "batched_tok_s": n / t_batch}


# ----------------------------------------------------------------------------- sections
def bench_engine(llm: LLM, texts: list[str], max_tokens: int) -> dict[str, float]:
    llm.generate(texts[:1], greedy(4))  # warm-up
    sp = greedy(max_tokens)
    _, t_seq = timed(lambda: [llm.generate([t], sp) for t in texts])
    _, t_batch = timed(lambda: llm.generate(texts, sp))
    n = len(texts) * max_tokens
    return {"batch1_tok_s": n / t_seq, "batched_tok_s": n / t_batch}


def section_throughput(llm: LLM, hf, args) -> dict:
    texts = prompts(args.num_prompts)
    out = {"engine": bench_engine(llm, texts, args.max_tokens)}
    if hf is not None:
        out["transformers"] = bench_hf(hf, texts, args.max_tokens, llm.tokenizer)
    return out


def engine_decode_tok_s(llm: LLM, ids: list[int], n: int) -> float:
    """Decode rate of one stream: tokens after the first over the time after the first token."""
    r = llm.generate([ids], greedy(n))[0]
    m = r.metrics
    return (r.usage.completion_tokens - 1) / (m.total_s - m.ttft_s)


def hf_decode_tok_s(hf, ids: list[int], n: int) -> float:
    """Same rate for transformers: (time of n tokens − time of 1 token) / (n − 1)."""
    _, t1 = timed(lambda: hf_generate(hf, ids, 1))
    _, tn = timed(lambda: hf_generate(hf, ids, n))
    return (n - 1) / max(tn - t1, 1e-9)


def section_decode(llm: LLM, hf, args) -> dict:
    ids = token_prompt(llm.tokenizer, 32, seed=1)
    n = args.decode_tokens
    llm.generate([ids], greedy(4))   # warm-up
    ours = statistics.median(engine_decode_tok_s(llm, ids, n) for _ in range(args.repeats))
    bw = measure_bandwidth(size_mib=64 if args.quick else 512)
    wbytes = weight_bytes(llm.engine.runner.model)
    ceiling = decode_ceiling(wbytes, bw["read_gb_s"])
    out = {"engine_tok_s": ours, "weight_bytes": wbytes, "bandwidth": bw, "ceiling_tok_s": ceiling,
           "fraction_of_ceiling": ours / ceiling}
    if hf is not None:
        hf_generate(hf, ids, 2)
        out["transformers_tok_s"] = statistics.median(hf_decode_tok_s(hf, ids, n) for _ in range(args.repeats))
        out["ratio_vs_transformers"] = ours / out["transformers_tok_s"]
    return out


def _ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    r = llm.generate([ids], greedy(1))[0]
    return r.metrics.ttft_s, r.usage.cached_tokens


def section_prefix(llm: LLM, args) -> dict:
    tok, plen = llm.tokenizer, args.prefix_len
    off = LLM(args.model, loaded=llm.engine.loaded, enable_prefix_caching=False, kv_cache_memory_bytes=args.kv_bytes)
    hits, misses, cached = [], [], []
    for rep in range(args.repeats):
        prefix = token_prompt(tok, plen, seed=100 + rep)
        first, second = prefix + token_prompt(tok, 16, 200 + rep), prefix + token_prompt(tok, 16, 300 + rep)
        _ttft(llm, first)                             # fills the cache with the prefix
        t_hit, n_cached = _ttft(llm, second)
        t_miss, _ = _ttft(off, second)
        hits.append(t_hit)
        misses.append(t_miss)
        cached.append(n_cached)
    hit, miss = statistics.median(hits), statistics.median(misses)
    return {"prefix_len": plen, "ttft_hit_ms": hit * 1e3, "ttft_miss_ms": miss * 1e3, "hit_over_miss": hit / miss,
            "cached_tokens": min(cached)}


def _chunk_run(llm: LLM, long_ids: list[int], short: list[list[int]], decode_tokens: int) -> dict:
    eng = llm.engine
    for i, ids in enumerate(short):
        eng.add_request(f"short-{i}", ids, greedy(decode_tokens))
    started: set[str] = set()
    while len(started) < len(short):                   # until every short stream is decoding
        started |= {o.request_id for o in eng.step() if any(d.token_ids for d in o.deltas)}
    eng.add_request("long", long_ids, greedy(4))
    gaps, ttft, tokens, t0 = [], None, 0, time.perf_counter()
    while eng.has_unfinished_requests():
        outs, dt = timed(eng.step)
        gaps.append(dt)
        for o in outs:
            tokens += sum(len(d.token_ids) for d in o.deltas)
            if o.request_id == "long" and ttft is None and any(d.token_ids for d in o.deltas):
                ttft = time.perf_counter() - t0
    return {"long_ttft_ms": ttft * 1e3, "max_step_ms": max(gaps) * 1e3,
            "tok_s": tokens / (time.perf_counter() - t0)}


def section_chunked(llm: LLM, args) -> dict:
    tok = llm.tokenizer
    long_ids = token_prompt(tok, args.prefix_len, seed=7)
    short = [token_prompt(tok, 16, seed=10 + i) for i in range(4)]
    out = {}
    for budget in args.chunk_sizes:
        eng = LLM(args.model, loaded=llm.engine.loaded, max_num_batched_tokens=budget, enable_prefix_caching=False,
                  kv_cache_memory_bytes=args.kv_bytes)
        _chunk_run(eng, token_prompt(tok, 32, 99), short[:1], 2)   # warm-up
        out[str(budget)] = _chunk_run(eng, long_ids, short, args.chunk_decode_tokens)
    return out


# ----------------------------------------------------------------------------- report
def print_report(res: dict) -> None:
    if "throughput" in res:
        t = res["throughput"]
        print(f"{'throughput':<12} {'sluice tok/s':>13} {'transformers tok/s':>19} {'ratio':>7}")
        for row in ("batch1", "batched"):
            ours, theirs = t["engine"][f"{row}_tok_s"], t.get("transformers", {}).get(f"{row}_tok_s")
            print(f"{row:<12} {ours:13.1f} {theirs or float('nan'):19.1f} "
                  f"{(f'{ours / theirs:6.2f}x' if theirs else '   n/a'):>7}")
    if "decode" in res:
        d = res["decode"]
        print(f"decode (1 stream): sluice {d['engine_tok_s']:.1f} tok/s; ceiling {d['ceiling_tok_s']:.1f} tok/s "
              f"({d['weight_bytes'] / 1e6:.0f} MB weights / {d['bandwidth']['read_gb_s']:.1f} GB/s read) -> "
              f"{100 * d['fraction_of_ceiling']:.0f}% of ceiling"
              + (f"; transformers {d['transformers_tok_s']:.1f} tok/s -> x{d['ratio_vs_transformers']:.2f}"
                 if "transformers_tok_s" in d else ""))
    if "prefix" in res:
        p = res["prefix"]
        print(f"prefix ({p['prefix_len']} tokens): TTFT hit {p['ttft_hit_ms']:.1f} ms, miss {p['ttft_miss_ms']:.1f} ms "
              f"-> hit/miss {100 * p['hit_over_miss']:.1f}% ({p['cached_tokens']} tokens cached)")
    if "chunked" in res:
        print(f"{'chunk budget':<12} {'long TTFT ms':>13} {'worst step ms':>14} {'tok/s':>8}")
        for budget, c in res["chunked"].items():
            print(f"{budget:<12} {c['long_ttft_ms']:13.1f} {c['max_step_ms']:14.1f} {c['tok_s']:8.1f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens per single-stream decode run")
    ap.add_argument("--prefix-len", type=int, default=1024, help="shared prefix / long prompt length")
    ap.add_argument("--chunk-sizes", default="64,256,1024", help="step token budgets for the chunked section")
    ap.add_argument("--chunk-decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the engine and transformers")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20, help="KV pool of each engine (default 256 MiB)")
    ap.add_argument("--skip-hf", action="store_true", help="engine rows only (no transformers ratio)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes everywhere: a smoke run")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown section {bad[0]!r}; choose from {', '.join(SECTIONS)}")
    try:
        args.chunk_sizes = [int(v) for v in args.chunk_sizes.split(",")]
    except ValueError:
        ap.error(f"--chunk-sizes: expected comma-separated integers, got {args.chunk_sizes!r}")
    if args.quick:
        args.num_prompts, args.max_tokens, args.decode_tokens, args.repeats = 2, 4, 8, 1
        args.prefix_len, args.chunk_sizes, args.chunk_decode_tokens, args.kv_bytes = 64, [16, 64], 4, 16 << 20
    for name in ("num_prompts", "max_tokens", "decode_tokens", "prefix_len", "repeats", "chunk_decode_tokens",
                 "kv_bytes"):
        if getattr(args, name) < 1 or (name == "decode_tokens" and args.decode_tokens < 2):
            ap.error(f"--{name.replace('_', '-')}: must be a positive integer (decode-tokens >= 2)")
    if any(c < 1 for c in args.chunk_sizes):
        ap.error("--chunk-sizes: budgets must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # One copy of the weights for every engine here; a KV pool sized for the workload, not 1 GiB each.
    llm = LLM(args.model, loaded=load_model(args.model), kv_cache_memory_bytes=args.kv_bytes,
              num_threads=torch.get_num_threads())
    hf = None if args.skip_hf or not {"throughput", "decode"} & set(args.sections) else load_hf(args.model)
    res: dict = {"machine": machine(), "model": args.model, "device": llm.engine.model_info.device}
    if "throughput" in args.sections:
        res["throughput"] = section_throughput(llm, hf, args)
    if "decode" in args.sections:
        res["decode"] = section_decode(llm, hf, args)
    if "prefix" in args.sections:
        res["prefix"] = section_prefix(llm, args)
    if "chunked" in args.sections:
        res["chunked"] = section_chunked(llm, args)
    print(f"model={args.model} threads={torch.get_num_threads()} device={res['device']} cpu={res['machine'].get('Model name')}")
    print_report(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
