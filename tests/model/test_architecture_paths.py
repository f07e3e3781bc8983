"""Every supported architecture (``ARCHITECTURES``) through the engine's paths besides plain CPU
decoding (issue 43): the GPU path's kernels, speculative decoding, prefix caching and grammars.

One tiny random-weight transformers model per architecture (``tests/model/tiny_archs.py``, the
models the per-architecture tests hold to transformers), built once, served float32 on CPU:

* ``attention_backend=triton`` and ``sampler_backend=triton`` (CUDA's defaults; here the kernels
  run under the Triton interpreter): three prompts batched, one chunked past a block (16) and
  past the sliding windows, greedy tokens equal transformers'. Gemma 2 soft-caps its attention
  scores, which the Triton kernel cannot apply: the engine refuses it by name;
* n-gram speculative decoding, four requests batched (one forced onto a repeating token so that
  its drafts are accepted): the greedy tokens of the same engine without speculation;
* prefix caching: a second request sharing two blocks of the first's prompt is served those
  blocks from the cache (``usage.cached_tokens``) and gives the tokens of an engine without it;
* a json_schema constraint: the output parses and validates against the schema, finished by EOS.
"""
from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.models.config import ARCHITECTURES
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.model import tiny_archs

ARCHS = list(ARCHITECTURES)
_gen = torch.Generator().manual_seed(11)
# 5 tokens; 19 (past a block and every window); 9.
PROMPTS = [[3, 17, 400, 9, 5000]] + [torch.randint(2, 30000, (n,), generator=_gen).tolist() for n in (19, 9)]
NEW_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory, smollm2_tokenizer):
    """(architecture, transformers model, sluice's LoadedModel of the same weights)."""
    arch = request.param
    hf = tiny_archs.build(arch, smollm2_tokenizer.vocab_size)
    folder = tiny_archs.write_folder(tmp_path_factory.mktemp(f"tiny_{arch}"), hf, smollm2_tokenizer)
    loaded = load_model(str(folder), dtype="float32", device="cpu", quantization="none")
    assert loaded.arch.architecture == arch
    return arch, hf, loaded


def _theirs(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=n, do_sample=False)[0, len(p):].tolist() for p in prompts]


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _assert_idle(llm: LLM) -> None:
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.stats().in_use == 0


def test_triton_kernels_give_transformers_greedy_tokens(tiny):
    arch, hf, loaded = tiny
    opts = dict(attention_backend="triton", sampler_backend="triton", block_size=16, max_num_batched_tokens=16,
                kv_cache_memory_bytes=4 << 20)
    if arch == "gemma2":
        with pytest.raises(ValueError, match=r"attention_backend=triton: .* soft-caps its attention scores "
                                             r"\(attn_logit_softcapping\), which the triton backend cannot apply"):
            LLM(loaded=loaded, **opts)
        return
    llm = LLM(loaded=loaded, **opts)
    try:
        assert llm.engine.model_info.attention_backend == "triton"
        t = time.perf_counter()
        ours = _tokens(llm.generate(PROMPTS, GREEDY))
        print(f"{arch}: triton {time.perf_counter() - t:.1f}s")
        _assert_idle(llm)
    finally:
        llm.close()
    assert ours == _theirs(hf, PROMPTS, NEW_TOKENS)


def test_ngram_speculation_keeps_the_greedy_tokens_batched(tiny):
    arch, _, loaded = tiny
    repeating = [700, 701, 702, 703] * 3
    prompts = PROMPTS + [repeating]
    # The last request is forced onto token 77 (its n-grams then match, and their drafts are
    # accepted); the others are the model's own greedy continuations.
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(PROMPTS) + [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={77: 100.0})]
    want = _tokens(LLM(loaded=loaded).generate(prompts, params))
    llm = LLM(loaded=loaded, speculative_mode="ngram", spec_draft_length=3, spec_max_batch_size=8)
    try:
        results = llm.generate(prompts, params)
        stats = llm.engine.spec.stats
        _assert_idle(llm)
    finally:
        llm.close()
    assert _tokens(results) == want
    assert want[-1][2:] == [77] * 10
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats


def test_a_shared_prefix_is_served_from_the_cache(tiny):
    arch, _, loaded = tiny
    first = torch.randint(2, 30000, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    second = first[:32] + [41, 42, 43]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(loaded=loaded, block_size=16)
    try:
        a = llm.generate([first], params)[0]
        b = llm.generate([second], params)[0]
        _assert_idle(llm)
    finally:
        llm.close()
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == 32
    want = _tokens(LLM(loaded=loaded, block_size=16, enable_prefix_caching=False).generate([first, second], params))
    assert [a.outputs[0].token_ids, b.outputs[0].token_ids] == want


def test_a_json_schema_constrains_the_output(tiny):
    arch, _, loaded = tiny
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA), strict=True)
    llm = LLM(loaded=loaded)
    try:
        params = [SamplingParams(max_tokens=40, temperature=0.0, structured=spec),
                  SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=spec)]
        results = llm.generate([PROMPTS[0], PROMPTS[2]], params)
        assert not llm.engine.structured.request_ids()
    finally:
        llm.close()
    for res in results:
        out = res.outputs[0]
        assert out.finish_reason == "stop", (arch, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
