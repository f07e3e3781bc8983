"""Structured-output benchmark: what grammar masking costs a decode step, and what compiling costs.

    python bench/structured.py                        # SmolLM2-135M GGUF, every section
    python bench/structured.py --sections compile --json out.json
    python bench/structured.py --quick                # tiny smoke setting (not a measurement)

* **overhead**: decode tokens/s at batch 1 and at batch ``--streams`` (32), every request
  constrained by a JSON Schema that cannot end before ``--max-tokens`` (an array of at least 500
  strings), against the same requests unconstrained with ``ignore_eos``, in the same process. So
  both produce exactly ``--max-tokens`` tokens. Overhead = unconstrained rate / constrained rate
  - 1: the bitmask fill (xgrammar), the masking stage in the sampler and the matcher advance, per
  step. Decode rate = tokens after the first / (total - time to first token), from the engine's
  own timings (the compile and the prefill are not counted). The two runs alternate ``--repeat``
  times (each pair in turn order); the overhead is the median over the pairs, so that drift on a
  shared machine hits both alike, and the best rate of each is shown beside it.
* **compile**: each schema of the test suite (``tests/helpers/schemas.py``, 32 schemas) compiled
  on SmolLM2's vocabulary cold (a fresh manager: no cached grammar; the tokenizer info and the
  compiler are built beforehand and reported apart) and again from the cache: mean, p50, max.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sluice.engine.llm import LLM  # noqa: E402
from sluice.engine.loaders import load_model  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402
from sluice.engine.structured import GrammarSpec  # noqa: E402
from sluice.engine.structured.manager import StructuredOutputManager  # noqa: E402
from tests.helpers.schemas import SCHEMAS  # noqa: E402

SECTIONS = ("overhead", "compile")
ENDLESS = GrammarSpec("json_schema", json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 500}))
PROMPTS = ["Write a list of fruit names as JSON.", "List the colours of the rainbow as a JSON array.",
           "Give me a JSON array of city names.", "Name some animals, as JSON."]


def _rate(llm: LLM, texts: list[str], sp: SamplingParams) -> tuple[float, int]:
    results = llm._run(texts, [sp] * len(texts), add_special_tokens=False)
    tokens = [len(r.outputs[0].token_ids) for r in results]
    decode_s = sum(r.metrics.total_s - r.metrics.ttft_s for r in results)
    # Concurrent requests decode over the same wall time: their rate is the sum of tokens over it.
    wall = max(r.metrics.total_s - r.metrics.ttft_s for r in results) if len(results) > 1 else decode_s
    return sum(t - 1 for t in tokens) / wall, sum(tokens)


def overhead(loaded, args) -> list[dict]:
    llm = LLM(loaded=loaded, max_num_seqs=max(args.streams, 1))
    rows = []
    for batch in (1, args.streams):
        texts = [llm.engine.render_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
                 for i in range(batch)]
        plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=ENDLESS)
        _rate(llm, texts[:1], constrained)              # compile once, warm every path
        _rate(llm, texts[:1], plain)
        best = {"plain": (0.0, 0), "constrained": (0.0, 0)}
        ratios = []
        for i in range(args.repeat):
            # Alternate which goes first, and pair each plain run with the constrained run beside it.
            order = (("plain", plain), ("constrained", constrained))
            pair = {}
            for name, sp in (order if i % 2 == 0 else order[::-1]):
                pair[name] = _rate(llm, texts, sp)
                best[name] = max(best[name], pair[name])
            ratios.append(pair["plain"][0] / pair["constrained"][0])
        (p, pn), (c, cn) = best["plain"], best["constrained"]
        rows.append({"section": "overhead", "batch": batch, "tokens": cn, "same_token_count": pn == cn,
                     "plain_tok_s": round(p, 2), "constrained_tok_s": round(c, 2),
                     "overhead_pct": round(100 * (statistics.median(ratios) - 1), 1),
                     "overhead_pct_per_pair": [round(100 * (r - 1), 1) for r in ratios]})
        print(rows[-1], flush=True)
    return rows


def compile_times(loaded, args) -> list[dict]:
    tok, vocab = loaded.tokenizer, loaded.arch.vocab_size
    manager = StructuredOutputManager(tok, vocab)
    t0 = time.perf_counter()
    manager.warm_up().result()
    setup = time.perf_counter() - t0
    specs = [GrammarSpec("json_schema", json.dumps(s), strict=True) for s in list(SCHEMAS.values())[:args.schemas]]
    cold, cached = [], []
    for spec in specs:
        t0 = time.perf_counter()
        manager.compile(spec)
        cold.append(time.perf_counter() - t0)
    for spec in specs:
        t0 = time.perf_counter()
        manager.compile(spec)
        cached.append(time.perf_counter() - t0)
    manager.close()
    rows = [{"section": "compile", "setup_s": round(setup, 2), "schemas": len(specs), "which": name,
             "mean_ms": round(1000 * statistics.mean(xs), 3), "p50_ms": round(1000 * statistics.median(xs), 3),
             "max_ms": round(1000 * max(xs), 3)} for name, xs in (("cold", cold), ("cached", cached))]
    for row in rows:
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--schemas", type=int, default=len(SCHEMAS))
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not a measurement")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.max_tokens, args.repeat, args.schemas = 2, 6, 1, 3
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    loaded = load_model(args.model, dtype="float32", device="cpu")
    rows = []
    if "overhead" in sections:
        rows += overhead(loaded, args)
    if "compile" in sections:
        rows += compile_times(loaded, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
