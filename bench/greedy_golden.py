"""Record the tokens every engine mode produces on a fixed workload, and compare a later tree with
the record: the check that a refactor changed no behaviour.

    python bench/greedy_golden.py --write /tmp/golden/base.json     # on the tree before
    python bench/greedy_golden.py --check /tmp/golden/base.json     # on the tree after

The workload is 12 mixed requests run together (greedy with and without stop strings and
penalties, seeded sampling with ``n = 2``, top-k/top-p, logprobs, a JSON-schema grammar) on the
default model, through every weight format (float32 on the C++ stack and on the Python layers,
the file's own blocks, w8a8, int8, int4) and every proposer (ngram, small_draft with the model as
its own draft, EAGLE and Medusa chains and trees with seeded random heads). What is recorded per
request: each choice's token ids, finish reason and the rounded logprobs of the sampled tokens.
A mode that differs is printed with its first differing request; the exit status is 1 then.
Tokens must be identical; logprobs are compared to 1e-4 (a refactor may reorder a float sum).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.heads import EagleHead, MedusaHeads, eagle_config
from sluice.engine.structured.spec import GrammarSpec

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers and explain why they are prime.",
    "def fibonacci(n):",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "Once upon a time, in a small village by the mountains,",
]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "age": {"type": "integer", "minimum": 0}},
                     "required": ["name", "age"], "additionalProperties": False})


def workload() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(12):
        kw: dict = dict(temperature=0.0, max_tokens=(24, 32, 16, 28)[i % 4])
        if i % 4 == 1:
            kw["stop"] = ["."]
        if i % 6 == 2:
            kw.update(temperature=0.8, seed=100 + i, n=2, top_k=40, top_p=0.9)
        if i % 6 == 3:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2, logprobs=3)
        if i == 5:
            kw.update(structured=GrammarSpec(kind="json_schema", text=SCHEMA), max_tokens=40)
        if i == 10:
            kw.update(temperature=0.7, seed=7, min_p=0.05)
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(**kw))
    return prompts, params


def random_heads(arch, mode: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(arch.hidden_size, 4, 1) if mode == "medusa" else EagleHead(
        ModelArchConfig.from_hf_config(eagle_config(arch)))
    with torch.no_grad():
        for name, prm in heads.named_parameters():
            if "layernorm" not in name:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.05)
    return heads


def modes(quick: bool):
    """(name, environment overrides, loader options, engine options) per mode."""
    yield "float32", {}, dict(quantization="none"), {}
    yield "float32-python-layers", {"SLUICE_CPU_CPP_LAYERS": "0"}, dict(quantization="none"), {}
    yield "auto", {}, dict(quantization="auto"), {}
    if quick:
        return
    for q in ("w8a8", "int8", "int4"):
        yield q, {}, dict(quantization=q), {}
    spec = dict(spec_draft_length=4, spec_max_batch_size=1024)
    yield "ngram", {}, dict(quantization="auto"), dict(speculative_mode="ngram", **spec)
    yield "small_draft", {}, dict(quantization="auto"), dict(speculative_mode="small_draft", additional_models="smollm2",
                                                              draft="self", **spec)
    for head in ("eagle", "medusa"):
        for width in (1, 3):
            yield (f"{head}-{'tree' if width > 1 else 'chain'}", {}, dict(quantization="none"),
                   dict(speculative_mode=head, additional_models=f"random {head} heads", heads=head,
                        spec_tree_width=width, **spec))


def run_mode(loaded, env: dict, engine_opts: dict) -> list:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        opts = dict(engine_opts)
        if opts.pop("draft", None) == "self":
            opts["draft_loaded"] = loaded
        if "heads" in opts:
            opts["heads"] = random_heads(loaded.arch, opts["heads"])
        llm = LLM(loaded=loaded, seed=3, **opts)
        prompts, params = workload()
        texts = [llm.engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
        results = llm._run(texts, params, add_special_tokens=False)
        llm.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = []
    for r in results:
        out.append([{"tokens": list(c.token_ids), "finish": c.finish_reason,
                     "logprobs": [round(float(x.logprob), 5) for x in (c.logprobs or [])]}
                    for c in r.outputs])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    ap.add_argument("--quick", action="store_true", help="float32, Python layers and auto only")
    ap.add_argument("--only", nargs="*", help="mode names to run")
    args = ap.parse_args()
    torch.manual_seed(0)
    loads: dict = {}
    got: dict = {}
    for name, env, load_opts, engine_opts in modes(args.quick):
        if args.only and name not in args.only:
            continue
        key = load_opts["quantization"]
        if key not in loads:
            loads[key] = load_model("smollm2", dtype="float32", device="cpu", **load_opts)
        t = time.perf_counter()
        got[name] = run_mode(loads[key], env, engine_opts)
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    if args.write:
        os.makedirs(os.path.dirname(os.path.abspath(args.write)), exist_ok=True)
        with open(args.write, "w") as f:
            json.dump(got, f)
        print(f"wrote {len(got)} modes to {args.write}")
        return 0
    with open(args.check) as f:
        want = json.load(f)
    bad = 0
    for name, outs in got.items():
        if name not in want:
            print(f"{name}: not in the record")
            continue
        for i, (a, b) in enumerate(zip(outs, want[name])):
            same = len(a) == len(b) and all(
                x["tokens"] == y["tokens"] and x["finish"] == y["finish"] and len(x["logprobs"]) == len(y["logprobs"])
                and all(abs(p - q) <= 1e-4 for p, q in zip(x["logprobs"], y["logprobs"])) for x, y in zip(a, b))
            if not same:
                print(f"{name}: request {i} differs\n  now:    {a}\n  record: {b}")
                bad += 1
                break
        else:
            print(f"{name}: identical ({len(outs)} requests)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
