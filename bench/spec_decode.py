"""Speculative decoding benchmark: batch-1 decode with and without each mode, on input-grounded
prompts (edit a given text, rewrite code, summarise a given text) and open-ended ones, with the
mean accepted length; 32 concurrent streams with and without; a batch-size sweep that locates
where drafting stops paying (the ``spec_max_batch_size`` default). Every ratio is against a
baseline measured in the same process; greedy outputs are checked identical to the baseline.

    python bench/spec_decode.py                        # SmolLM2-135M GGUF, every section
    python bench/spec_decode.py --sections batch1 --json out.json
    python bench/spec_decode.py --quick                # tiny smoke setting (not a measurement)

Decode tokens/s per request = tokens after the first / (total time - time to first token), from
the engine's own timings, summed over the prompts of a group (so the prefill is not counted).
``small_draft`` uses the target as its own draft (no smaller model ships here): it shows the
mechanism's cost at 100% acceptance, not a speed-up. ``eagle`` and ``medusa`` run with the heads
in ``--heads DIR`` (``DIR/eagle``, ``DIR/medusa``, as ``sluice train-heads MODEL --out DIR``
writes them); without ``--heads`` they are trained first into ``--heads-cache`` (about half an
hour on 2 cores, once), or left out with ``--no-heads``. Where the heads draft from 8-bit block
copies (``spec_head_format`` auto on a CPU with AVX2 or AVX512-VNNI), each head mode also runs
drafting from the heads' float32 weights ("float32 head"), to show what the copies buy.

    python bench/spec_decode.py --sections batch1 --heads heads/smollm2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sluice.engine.llm import LLM  # noqa: E402
from sluice.engine.loaders import load_model  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402
from sluice.engine.spec_decode.config import DEFAULT_TREE_WIDTH  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import GROUNDED, OPEN  # noqa: E402

SECTIONS = ("batch1", "concurrent", "sweep")


def chat_prompts(llm: LLM, prompts: list[str]) -> list[str]:
    return [llm.engine.render_chat([{"role": "user", "content": p}]) for p in prompts]


def run(llm: LLM, texts: list[str], max_tokens: int, one_by_one: bool) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec = llm.engine.spec
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    t0 = time.perf_counter()
    if one_by_one:
        results = [llm._run([t], [sp], add_special_tokens=False)[0] for t in texts]
    else:
        results = llm._run(texts, [sp] * len(texts), add_special_tokens=False)
    wall = time.perf_counter() - t0
    tokens = [r.outputs[0].token_ids for r in results]
    after_first = sum(len(t) - 1 for t in tokens)
    decode_s = sum(r.metrics.total_s - r.metrics.ttft_s for r in results)
    drafts = (spec.stats.num_drafts - before[0]) if spec else 0
    accepted = (spec.stats.num_accepted_tokens - before[1]) if spec else 0
    return {"tokens": tokens, "num_tokens": sum(map(len, tokens)), "wall_s": wall,
            "decode_tok_s": after_first / decode_s if decode_s > 0 else 0.0,
            "throughput_tok_s": sum(map(len, tokens)) / wall,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else None, "drafts": drafts}


def engines(loaded, k: int, heads: Path | None = None, **opts):
    yield "disable", LLM(loaded=loaded, **opts)
    yield "ngram", LLM(loaded=loaded, speculative_mode="ngram", spec_draft_length=k, **opts)
    yield "small_draft", LLM(loaded=loaded, draft_loaded=loaded, speculative_mode="small_draft",
                             additional_models="(the target)", spec_draft_length=k, **opts)
    if heads is None:
        return
    from sluice.engine.spec_decode.heads import load_medusa, resolve_head_format

    medusa_k = min(k, load_medusa(heads / "medusa", loaded.arch).num_heads)
    for mode, mode_k in (("eagle", k), ("medusa", medusa_k)):
        # The defaults (draft trees where they pay, chains elsewhere: factory.resolve_tree_width)
        # and the other shape; every one of a chain's K drafts proposed (spec_min_draft_prob 0),
        # to show what the cut at the head's confidence buys. Where the heads draft in w8a8
        # (spec_head_format auto on a CPU with the vectorized block kernels), also with their
        # float32 weights, to show what the 8-bit copies buy.
        common = dict(speculative_mode=mode, additional_models=str(heads / mode), spec_draft_length=mode_k)
        default = LLM(loaded=loaded, **common, **opts)
        yield f"{mode} ({'tree' if default.engine.spec.proposer.tree_width > 1 else 'chain'}, the default)", default
        if default.engine.spec.proposer.tree_width > 1:
            yield f"{mode} (chain)", LLM(loaded=loaded, **common, spec_tree_width=1, **opts)
        elif loaded.model.supports_draft_trees(default.engine.runner.attn):
            yield f"{mode} (tree)", LLM(loaded=loaded, **common, spec_tree_width=DEFAULT_TREE_WIDTH, **opts)
        yield f"{mode} (chain, all K)", LLM(loaded=loaded, **common, spec_tree_width=1, spec_min_draft_prob=0.0,
                                            **opts)
        if resolve_head_format("auto", loaded.device) == "w8a8":
            yield f"{mode} (float32 head)", LLM(loaded=loaded, **common, spec_head_format="float32", **opts)


def heads_folder(args) -> Path | None:
    """``--heads``, or heads trained once into ``--heads-cache`` (None with ``--no-heads``)."""
    if args.no_heads:
        return None
    if args.heads:
        return Path(args.heads)
    cache = Path(args.heads_cache or Path.home() / ".cache" / "sluice" / "heads" / Path(args.model).name)
    if not ((cache / "eagle" / "config.json").is_file() and (cache / "medusa" / "config.json").is_file()):
        from sluice.engine.training import train

        print(f"training heads into {cache} (sluice train-heads {args.model} --out {cache})", flush=True)
        extra = ["--num-prompts", "8", "--max-tokens", "16", "--medusa-epochs", "1", "--eagle-epochs", "1"] \
            if args.quick else []
        train.main([args.model, "--out", str(cache), *extra])
    return cache


def batch1(loaded, args) -> list[dict]:
    """Prompt by prompt, every mode in turn (so drift on a shared machine hits all alike)."""
    llms = dict(engines(loaded, args.k, heads_folder(args)))
    for llm in llms.values():
        run(llm, chat_prompts(llm, OPEN[:1]), 8, True)   # warm-up
    rows = []
    for group, prompts in (("input-grounded", GROUNDED), ("open-ended", OPEN)):
        per_mode = {m: [] for m in llms}
        for text in chat_prompts(llms["disable"], prompts[:args.num_prompts]):
            for mode, llm in llms.items():
                per_mode[mode].append(run(llm, [text], args.max_tokens, True))
        ref = _merge(per_mode["disable"])
        for mode, runs in per_mode.items():
            r = _merge(runs)
            rows.append({"section": "batch1", "mode": mode, "prompts": group, "num_tokens": r["num_tokens"],
                         "decode_tok_s": round(r["decode_tok_s"], 2),
                         "speedup": round(r["decode_tok_s"] / ref["decode_tok_s"], 2),
                         "mean_accepted_length": r["mean_accepted_length"] and round(r["mean_accepted_length"], 2),
                         "identical": r["tokens"] == ref["tokens"]})
            print(rows[-1], flush=True)
    return rows


def _merge(runs: list[dict]) -> dict:
    """One group's totals from per-prompt runs: decode rate = tokens after the first / decode time."""
    tokens = [t for r in runs for t in r["tokens"]]
    decode_s = sum((r["num_tokens"] - len(r["tokens"])) / r["decode_tok_s"] for r in runs if r["decode_tok_s"])
    drafts = sum(r["drafts"] for r in runs)
    accepted = sum((r["mean_accepted_length"] - 1.0) * r["drafts"] for r in runs if r["drafts"])
    return {"tokens": tokens, "num_tokens": sum(map(len, tokens)),
            "decode_tok_s": sum(len(t) - 1 for t in tokens) / decode_s if decode_s else 0.0,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else None}


def concurrent(loaded, args) -> list[dict]:
    rows, base = [], None
    prompts = (GROUNDED + OPEN) * (args.streams // 8 + 1)
    opts = dict(max_num_seqs=args.streams)
    configs = [("disable", {}), ("ngram", dict(speculative_mode="ngram", spec_draft_length=args.k)),
               ("ngram, drafting forced on", dict(speculative_mode="ngram", spec_draft_length=args.k,
                                                  spec_max_batch_size=args.streams))]
    heads = heads_folder(args)
    if heads is not None:   # above spec_max_batch_size: no drafts, but EAGLE still follows every request
        from sluice.engine.spec_decode.heads import load_medusa

        medusa_k = min(args.k, load_medusa(heads / "medusa", loaded.arch).num_heads)
        configs += [(mode, dict(speculative_mode=mode, additional_models=str(heads / mode), spec_draft_length=k))
                    for mode, k in (("eagle", args.k), ("medusa", medusa_k))]
    for name, kw in configs:
        llm = LLM(loaded=loaded, **opts, **kw)
        texts = chat_prompts(llm, prompts[:args.streams])
        run(llm, texts[:2], 4, False)   # warm-up
        r = run(llm, texts, args.stream_tokens, False)
        base = base or r
        rows.append({"section": "concurrent", "mode": name, "streams": args.streams, "num_tokens": r["num_tokens"],
                     "throughput_tok_s": round(r["throughput_tok_s"], 2),
                     "ratio": round(r["throughput_tok_s"] / base["throughput_tok_s"], 3),
                     "mean_accepted_length": r["mean_accepted_length"] and round(r["mean_accepted_length"], 2),
                     "identical": r["tokens"] == base["tokens"]})
        print(rows[-1], flush=True)
    return rows


def sweep(loaded, args) -> list[dict]:
    """Throughput with and without ngram drafting at several batch sizes, on grounded prompts."""
    rows = []
    for bs in args.sweep:
        texts = None
        res = {}
        for name, kw in (("disable", {}), ("ngram", dict(speculative_mode="ngram", spec_draft_length=args.k,
                                                          spec_max_batch_size=bs))):
            llm = LLM(loaded=loaded, max_num_seqs=bs, **kw)
            texts = texts or chat_prompts(llm, (GROUNDED + OPEN) * (bs // 8 + 1))[:bs]
            run(llm, texts[:1], 4, False)
            res[name] = run(llm, texts, args.stream_tokens, False)
        rows.append({"section": "sweep", "batch_size": bs,
                     "disable_tok_s": round(res["disable"]["throughput_tok_s"], 2),
                     "ngram_tok_s": round(res["ngram"]["throughput_tok_s"], 2),
                     "ratio": round(res["ngram"]["throughput_tok_s"] / res["disable"]["throughput_tok_s"], 2)})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default="none",
                   help="the target's weight format (none: float32, the figures in bench/README.md; w4a8...)")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--k", type=int, default=5, help="spec_draft_length")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--sweep", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4, 8])
    p.add_argument("--heads", default=None, help="folder with eagle/ and medusa/ heads (sluice train-heads)")
    p.add_argument("--heads-cache", default=None,
                   help="where heads are trained when --heads is not given (default: ~/.cache/sluice/heads/MODEL)")
    p.add_argument("--no-heads", action="store_true", help="leave eagle and medusa out")
    p.add_argument("--quick", action="store_true", help="tiny setting: checks the script runs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.num_prompts, args.streams, args.stream_tokens, args.sweep = 8, 1, 4, 4, [1, 2]
    loaded = load_model(args.model, dtype="float32", device=args.device, quantization=args.quantization)
    rows = []
    for section in args.sections.split(","):
        rows += {"batch1": batch1, "concurrent": concurrent, "sweep": sweep}[section](loaded, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
