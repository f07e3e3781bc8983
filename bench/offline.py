"""Offline throughput: sluice's engine against transformers ``generate`` on the same weights,
measured in the same process, printed as ratios.

    python bench/offline.py                      # SmolLM2-135M GGUF, 8 prompts x 64 tokens
    python bench/offline.py --num-prompts 32 --max-tokens 128 --json out.json
    python bench/offline.py --quick              # tiny smoke setting

Rows: batch 1 (prompts one after another) and batched (all prompts at once). Every run
generates exactly ``--max-tokens`` tokens per prompt (EOS ignored) so the counts are equal.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.llm import LLM  # noqa: E402
from engine.models.registry import resolve_model_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

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


def prompts(n: int) -> list[str]:
    return [BASE_PROMPTS[i % len(BASE_PROMPTS)] + f" (variant {i})" for i in range(n)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_engine(llm: LLM, texts: list[str], max_tokens: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    _, t_seq = timed(lambda: [llm.generate([t], sp) for t in texts])
    _, t_batch = timed(lambda: llm.generate(texts, sp))
    n = len(texts) * max_tokens
    return {"batch1_tok_s": n / t_seq, "batched_tok_s": n / t_batch}


def bench_hf(texts: list[str], max_tokens: int, tokenizer) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)

    def one(t):
        ids = torch.tensor([tokenizer.encode(t)])
        return model.generate(ids, attention_mask=torch.ones_like(ids), **kw)

    def batched():
        enc = [tokenizer.encode(t) for t in texts]
        width = max(map(len, enc))
        ids = torch.tensor([[0] * (width - len(e)) + e for e in enc])          # left padding
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
        return model.generate(ids, attention_mask=mask, **kw)

    with torch.inference_mode():
        one(texts[0])  # warm-up
        _, t_seq = timed(lambda: [one(t) for t in texts])
        _, t_batch = timed(batched)
    n = len(texts) * max_tokens
    return {"batch1_tok_s": n / t_seq, "batched_tok_s": n / t_batch}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true", help="engine rows only (no ratio)")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 8 tokens: a smoke run")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens = 2, 8
    texts = prompts(args.num_prompts)
    llm = LLM(args.model)
    results = {"engine": bench_engine(llm, texts, args.max_tokens)}
    if not args.skip_hf:
        results["transformers"] = bench_hf(texts, args.max_tokens, llm.tokenizer)
    print(f"model={args.model} prompts={args.num_prompts} max_tokens={args.max_tokens} "
          f"threads={torch.get_num_threads()} device={llm.engine.model_info.device}")
    print(f"{'row':<10} {'sluice tok/s':>13} {'transformers tok/s':>19} {'ratio':>7}")
    for row in ("batch1", "batched"):
        ours = results["engine"][f"{row}_tok_s"]
        theirs = results.get("transformers", {}).get(f"{row}_tok_s")
        ratio = f"{ours / theirs:6.2f}x" if theirs else "   n/a"
        print(f"{row:<10} {ours:13.1f} {theirs or float('nan'):19.1f} {ratio:>7}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
