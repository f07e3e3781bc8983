"""Every supported architecture (``ARCHITECTURES``) through the engine's paths besides plain CPU
decoding (issue 43): the GPU path's kernels, speculative decoding, prefix caching and grammars.

One tiny random-weight transformers model per architecture (``tests/model/tiny_archs.py``, the
models the per-architecture tests hold to transformers), built and loaded once, served float32:

* the GPU path: ``attention_backend=triton`` and ``sampler_backend=triton`` (CUDA's defaults;
  here the kernels run under the Triton interpreter). Three prompts batched, one chunked past a
  block (16) and past the sliding windows: greedy tokens equal transformers', again when that
  prompt's first block comes from the prefix cache. Then n-gram speculation and json_schema
  grammars in one batch on the same kernels, and Medusa draft trees. float16 (Triton attention) and bfloat16 (torch
  attention) logits are as close to float32 as transformers' own in that dtype. Gemma 2 soft-caps its
  attention scores, which the Triton kernel cannot apply: ``attention_backend=triton`` is refused
  by name, and its GPU path is torch attention with the Triton sampler (what ``auto`` picks);
* the CPU path (the C++ layer stack, over float32 weights and over w8a8's 8-bit blocks): n-gram speculation, four requests batched (one forced onto
  a repeating token so that its drafts are accepted), gives the tokens of the same engine without
  speculation; a second request sharing two blocks of the first's prompt is served them from the
  prefix cache (``usage.cached_tokens``) and gives the tokens of an engine without the cache; a
  json_schema constraint's outputs, greedy and sampled, validate against the schema; Medusa
  draft trees keep the greedy tokens.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import jsonschema
import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import LoadedModel, load_model
from sluice.engine.models.config import ARCHITECTURES
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.model import tiny_archs

ARCHS = list(ARCHITECTURES)
_gen = torch.Generator().manual_seed(11)
# 5 tokens; 19 (past a block of 16 and every window); 9.
PROMPTS = [[3, 17, 400, 9, 5000]] + [torch.randint(2, 30000, (n,), generator=_gen).tolist() for n in (19, 9)]
NEW_TOKENS = 6
# A prompt n-grams match in; its request is forced onto FORCED, whose own n-grams then match too.
REPEATING, FORCED = [700, 701, 702, 703] * 3, 77
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}
# On the interpreted kernels, where each step costs ~0.1 s: a few tokens long.
SHORT_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# Engines sized small: each engine warms its packed projections up for every step size it can
# run (models.cpu_linear.warm_up_row_buckets), ~3 s per model at the defaults' sizes here.
SMALL = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)
# The GPU path's kernels: compiled for CUDA where there is one, else run by the Triton interpreter.
GPU = "cuda" if torch.cuda.is_available() else "cpu"
GPU_KERNELS = dict(device=GPU, attention_backend="triton", sampler_backend="triton", block_size=16,
                   max_num_batched_tokens=16)


class Tiny(NamedTuple):
    arch: str
    hf: torch.nn.Module          # transformers' model, float32 on CPU
    loaded: LoadedModel          # sluice's, float32 on CPU
    on_gpu: LoadedModel          # sluice's on the GPU path's device (CUDA if present, else the CPU one)
    w8a8: LoadedModel            # sluice's in a CPU block format (8-bit blocks, int8 activations)
    folder: Path

    def cpu(self, fmt: str) -> LoadedModel:
        return self.loaded if fmt == "float32" else self.w8a8


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory, smollm2_tokenizer) -> Tiny:
    arch = request.param
    hf = tiny_archs.build(arch, smollm2_tokenizer.vocab_size)
    folder = tiny_archs.write_folder(tmp_path_factory.mktemp(f"tiny_{arch}"), hf, smollm2_tokenizer)
    loaded = load_model(str(folder), dtype="float32", device="cpu", quantization="none")
    assert loaded.arch.architecture == arch
    on_gpu = loaded if GPU == "cpu" else load_model(str(folder), dtype="float32", device=GPU, quantization="none")
    w8a8 = load_model(str(folder), dtype="float32", device="cpu", quantization="w8a8")
    return Tiny(arch, hf, loaded, on_gpu, w8a8, folder)


def _theirs(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=n, do_sample=False)[0, len(p):].tolist() for p in prompts]


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _run(llm: LLM, prompts, params):
    """The results, after which every block is back in the pool and no grammar matcher is left."""
    try:
        results = llm.generate(prompts, params)
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.stats().in_use == 0 and not llm.engine.structured.request_ids()
        return results
    finally:
        llm.close()


def _greedy(n: int, **bias) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **bias)


def _constrained(schema: dict, temperatures=(0.0, 1.0)) -> list[SamplingParams]:
    spec = GrammarSpec("json_schema", json.dumps(schema), strict=True)
    return [SamplingParams(max_tokens=40, temperature=t, seed=3, structured=spec) for t in temperatures]


def _assert_valid(arch: str, results, schema: dict) -> None:
    for res in results:
        out = res.outputs[0]
        assert out.finish_reason == "stop", (arch, out.text)
        jsonschema.validate(json.loads(out.text), schema)


# ---- the GPU path (Triton kernels, under the interpreter here) -----------------------------------
def test_triton_kernels_give_transformers_greedy_tokens(tiny):
    arch, hf, loaded = tiny.arch, tiny.hf, tiny.on_gpu
    if arch == "gemma2":
        with pytest.raises(ValueError, match=r"attention_backend=triton: .* soft-caps its attention scores "
                                             r"\(attn_logit_softcapping\), which the triton backend cannot apply"):
            LLM(loaded=loaded, **{**SMALL, **GPU_KERNELS})
        return
    llm = LLM(loaded=loaded, **{**SMALL, **GPU_KERNELS})
    assert llm.engine.model_info.attention_backend == "triton"
    theirs = _theirs(hf, PROMPTS, NEW_TOKENS)
    assert _tokens(llm.generate(PROMPTS, _greedy(NEW_TOKENS))) == theirs
    # Again: the 19-token prompt's first block comes from the prefix cache, the rest through the
    # kernels reading it.
    (again,) = _run(llm, PROMPTS[1:2], _greedy(NEW_TOKENS))
    assert again.usage.cached_tokens == 16 and again.outputs[0].token_ids == theirs[1]


def test_triton_kernels_speculate_and_constrain_batched(tiny):
    """n-gram drafts verified through the Triton kernels (several query rows per request in the
    prefill kernel) and grammar masks applied by the Triton sampler, in one batch: the greedy
    requests keep transformers' tokens, the constrained ones validate."""
    arch, hf, loaded = tiny.arch, tiny.hf, tiny.on_gpu
    kernels = {**GPU_KERNELS, "attention_backend": "torch"} if arch == "gemma2" else GPU_KERNELS
    llm = LLM(loaded=loaded, speculative_mode="ngram", spec_draft_length=3, spec_max_batch_size=8,
              **{**SMALL, **kernels, "max_num_batched_tokens": 64})       # prefills in one step
    assert llm.engine.model_info.attention_backend == kernels["attention_backend"]
    prompts = [PROMPTS[1], REPEATING, PROMPTS[0]]
    # The forced request short: its bias runs the penalties kernel, the interpreter's slowest (~0.3 s a step).
    params = [_greedy(NEW_TOKENS), _greedy(4, logit_bias={FORCED: 100.0})] + _constrained(SHORT_SCHEMA, [1.0])
    results = _run(llm, prompts, params)
    stats = llm.engine.spec.stats
    assert _tokens(results[:2]) == [*_theirs(hf, prompts[:1], NEW_TOKENS), [FORCED] * 4]
    assert stats.num_accepted_tokens > 0, stats
    _assert_valid(arch, results[2:], SHORT_SCHEMA)


@pytest.mark.parametrize("path", ["gpu", "float32", "w8a8"])
def test_draft_trees_keep_the_greedy_tokens(tiny, path):
    """Medusa draft trees (random heads, width 3, every node kept): the tree's rows attend
    through the tree mask (the Triton prefill kernel's, or the C++ stack's), past the sliding
    windows, and greedy output is transformers' (GPU path) or the engine's without speculation."""
    from tests.model.test_spec_decode_distribution import random_heads

    if path == "gpu":
        loaded, prompts, n = tiny.on_gpu, PROMPTS[:2], NEW_TOKENS
        opts = {**SMALL, **GPU_KERNELS, "attention_backend": "torch" if tiny.arch == "gemma2" else "triton",
                "max_num_batched_tokens": 64}
        want = _theirs(tiny.hf, prompts, n)
    else:
        loaded, prompts, n, opts = tiny.cpu(path), PROMPTS + [REPEATING], 10, SMALL
        want = _tokens(_run(LLM(loaded=loaded, **opts), prompts, _greedy(n)))
    llm = LLM(loaded=loaded, speculative_mode="medusa", additional_models="random medusa heads",
              heads=random_heads(loaded, "medusa"), spec_tree_width=3, spec_min_draft_prob=0.0,
              spec_draft_length=3, spec_max_batch_size=8, **opts)
    assert _tokens(_run(llm, prompts, _greedy(n))) == want
    assert llm.engine.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_logits_are_as_close_as_transformers_own(tiny, dtype):
    """A GPU serves in the compute dtype: sluice's float16 / bfloat16 logits (a prefill of 18
    tokens and a decode step through the paged cache) are as close to float32 transformers as
    transformers' own run in that dtype (within 2x its error). Through the Triton kernels, but for
    bfloat16 under the interpreter (which cannot run bfloat16 ``tl.dot``: tests/kernels/conftest.py)
    and Gemma 2: torch attention there."""
    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.attention.triton_backend import TritonAttentionBackend
    from sluice.engine.loaders import build_model
    from sluice.engine.loaders.hf_loader import load_hf_folder
    from tests.model.test_logits import _blocks_for, _caches, _meta

    arch, hf = tiny.arch, tiny.hf
    ids = PROMPTS[1]
    config, weights = load_hf_folder(tiny.folder)
    model = build_model(config, weights, dtype, torch.device(GPU))
    triton = arch != "gemma2" and (dtype == torch.float16 or GPU == "cuda")
    backend = TritonAttentionBackend() if triton else TorchAttentionBackend()
    table = _blocks_for(len(ids), 1)
    caches = [(k.to(GPU, dtype), v.to(GPU, dtype)) for k, v in _caches(config, max(table) + 1)]
    ours = []
    with torch.inference_mode():
        for start, count in ((0, 18), (18, 1)):
            meta = _on_gpu(_meta([start], [count], [table]))
            hidden = model(torch.tensor(ids[start:start + count], device=GPU),
                           torch.arange(start, start + count, device=GPU), caches, meta, backend)
            ours.append(model.compute_logits(hidden).float().cpu())
        ref = hf(torch.tensor([ids])).logits[0].float()                      # [19, vocab]
        theirs = copy.deepcopy(hf).to(dtype)(torch.tensor([ids])).logits[0].float()
    error, own = (torch.cat(ours) - ref).abs().max(), (theirs - ref).abs().max()
    assert error <= 2 * own + 1e-3, (arch, float(error), float(own))


def _on_gpu(meta):
    """The metadata's tensors on the GPU path's device."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(GPU) for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})


# ---- the CPU path (the C++ layer stack, float32 and a block format) -----------------------------
FORMATS = ["float32", "w8a8"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_ngram_speculation_keeps_the_greedy_tokens_batched(tiny, fmt):
    arch, loaded = tiny.arch, tiny.cpu(fmt)
    prompts = PROMPTS + [REPEATING]
    params = [_greedy(12)] * len(PROMPTS) + [_greedy(12, logit_bias={FORCED: 100.0})]
    base = LLM(loaded=loaded, **SMALL)
    assert base.engine.runner.model._cpu_decoder() is not None, f"{arch} runs on the Python layers"
    want = _tokens(_run(base, prompts, params))
    llm = LLM(loaded=loaded, speculative_mode="ngram", spec_draft_length=3, spec_max_batch_size=8, **SMALL)
    got = _tokens(_run(llm, prompts, params))
    stats = llm.engine.spec.stats
    assert got == want and want[-1] == [FORCED] * 12
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shared_prefix_is_served_from_the_cache(tiny, fmt):
    loaded = tiny.cpu(fmt)
    first = torch.randint(2, 30000, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    second = first[:32] + [41, 42, 43]
    llm = LLM(loaded=loaded, block_size=16, **SMALL)
    a = llm.generate([first], _greedy(6))[0]
    (b,) = _run(llm, [second], _greedy(6))
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == 32
    assert llm.engine.kv.prefix_cache_hit_rate > 0
    uncached = LLM(loaded=loaded, block_size=16, enable_prefix_caching=False, **SMALL)
    assert _tokens([a, b]) == _tokens(_run(uncached, [first, second], _greedy(6)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_json_schema_constrains_the_output(tiny, fmt):
    arch, loaded = tiny.arch, tiny.cpu(fmt)
    _assert_valid(arch, _run(LLM(loaded=loaded, **SMALL), [PROMPTS[0], PROMPTS[2]], _constrained(SCHEMA)), SCHEMA)
