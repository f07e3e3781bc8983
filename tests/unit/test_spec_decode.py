"""Speculative decoding on the tiny random-weight model: the n-gram lookup, the config errors
(before anything loads), per-row sampling state, greedy output identical to no speculation
with both proposers (stops, max_tokens, logprobs inside accepted runs), and the KV pool back to
its baseline after rejections, cancellations and preemptions, with no unverified token cached."""
from __future__ import annotations

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, SamplingBatch
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.ngram import ngram_lookup
from sluice.engine.spec_decode.rows import rows_of
from tests.tiny_model import VOCAB, prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
OPTS = dict(device="cpu", block_size=4, max_total_tokens=2048, num_threads=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(folder):
    return load_model(str(folder))


@pytest.fixture(scope="module")
def base(tiny):
    return LLM(loaded=tiny, **OPTS)


def _spec(tiny, mode: str, folder, **kw) -> LLM:
    if mode == "small_draft":
        kw = dict(additional_models=str(folder), draft_loaded=tiny) | kw
    return LLM(loaded=tiny, speculative_mode=mode, **(OPTS | dict(spec_max_batch_size=8) | kw))


# ---- the n-gram lookup ------------------------------------------------------------------------
def test_ngram_lookup_prefers_the_longest_then_the_latest_match():
    toks = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0: what followed it
    assert ngram_lookup(toks, 3, max_n=3, min_n=1) == [9, 8, 2]
    # only 2-grams allowed: [2, 3] latest earlier at 5 -> 7 6
    assert ngram_lookup(toks, 2, max_n=2, min_n=1) == [7, 6]
    assert ngram_lookup([4, 5, 6], 3, max_n=3, min_n=1) == []      # nothing repeats
    assert ngram_lookup([4, 5, 4], 5, max_n=3, min_n=1) == [5, 4]  # runs to the end at most
    assert ngram_lookup([4, 5, 4], 5, max_n=3, min_n=2) == []      # 1-grams not allowed


# ---- configuration errors ---------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(speculative_mode="bogus"), "speculative_mode: must be one of disable, ngram, small_draft"),
    (dict(speculative_mode="eagle"), "additional_models: speculative_mode eagle needs EAGLE heads"),
    (dict(speculative_mode="medusa"), "additional_models: speculative_mode medusa needs Medusa heads"),
    (dict(speculative_mode="small_draft"), "additional_models: speculative_mode small_draft needs a draft model"),
    (dict(speculative_mode="ngram", additional_models="x"),
     "additional_models: only speculative_mode small_draft, eagle or medusa load additional models, not ngram"),
    (dict(speculative_mode="ngram", spec_draft_length=0), "spec_draft_length: must be an integer in [1, 16]"),
    (dict(speculative_mode="ngram", spec_draft_length=17), "spec_draft_length: must be an integer in [1, 16]"),
    (dict(speculative_mode="ngram", spec_ngram_min=4, spec_ngram_max=2), "spec_ngram_min: must be <= spec_ngram_max"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens: drafts need a proposer"),
])
def test_bad_configuration_fails_before_anything_loads(tmp_path, kw, message):
    missing = tmp_path / "no-such-model"   # loading it would raise ModelLoadError, not ValueError
    with pytest.raises(ValueError) as err:
        LLM(str(missing), device="cpu", **kw)
    assert message in str(err.value)


def test_draft_with_another_vocabulary_is_refused_at_start_up(tiny, folder, tmp_path):
    import json

    other = write_tiny_folder(tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["renamed"] = vocab.pop("w7")   # same size, one id spelt differently
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="spells token 7 'renamed', the target 'w7'"):
        LLM(loaded=tiny, speculative_mode="small_draft", additional_models=str(other), **OPTS)


def test_speculative_config_defaults_off():
    cfg = SpeculativeConfig()
    assert not cfg.enabled and cfg.num_speculative_tokens == 0
    assert SpeculativeConfig(speculative_mode="ngram", spec_draft_length=5).num_speculative_tokens == 5


# ---- per-row sampling state -------------------------------------------------------------------
def test_rows_see_the_drafts_before_their_position():
    sp = SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=4,
                        stop_token_ids=[9], seed=3, logit_bias={2: 1.0})
    req = Request("r", [1, 2, 3], sp, eos_token_ids=frozenset({5}))
    req.output_token_ids = [7]
    drafts = [8, 8, 9]
    rows = rows_of(req, drafts)
    got = SamplingBatch.from_rows(rows, VOCAB, "cpu", GeneratorCache())
    for j in range(len(drafts) + 1):   # row j == the request with drafts[:j] appended
        alone = Request("r", [1, 2, 3], sp, eos_token_ids=frozenset({5}))
        alone.output_token_ids = [7] + drafts[:j]
        want = SamplingBatch.from_requests([alone], VOCAB, "cpu", GeneratorCache())
        for name in ("output_counts", "seen_mask", "forbidden", "philox_offsets", "bias_values"):
            g, w = getattr(got, name), getattr(want, name)
            assert g is not None, name
            # A stage no row of the lone batch needs is None there: an all-zero row here.
            assert torch.equal(g[j], w[0] if w is not None else torch.zeros_like(g[j])), (name, j)
    assert got.forbidden[0].any() and not got.forbidden[3].any()   # row 3 has 4 outputs: min_tokens met


# ---- greedy output identical ------------------------------------------------------------------
def _tokens(llm, prompts, sp):
    return [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, sp)]


@pytest.mark.parametrize("mode", ["ngram", "small_draft"])
def test_greedy_identical_to_no_speculation(base, tiny, folder, mode):
    llm = _spec(tiny, mode, folder)
    prompts = [prompt(5), prompt(23) + " w1 w2 w3 w1 w2", prompt(40), "w9 w9 w9 w9"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, presence_penalty=0.2)
    want = base.generate(prompts, sp)
    got = llm.generate(prompts, sp)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    usage = [r.usage for r in got]
    assert sum(u.draft_tokens for u in usage) > 0
    if mode == "small_draft":   # the target as its own draft: nothing is rejected
        assert all(u.accepted_tokens == u.draft_tokens for u in usage)
        assert llm.engine.spec.stats.num_accepted_tokens == llm.engine.spec.stats.num_draft_tokens


def test_stops_inside_an_accepted_run_cut_exactly_there(base, tiny, folder):
    # The target as its own draft accepts every greedy draft, so each stop falls inside a run.
    llm = _spec(tiny, "small_draft", folder, spec_draft_length=8)
    p = prompt(9)
    full = base.generate([p], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop_tok = full.token_ids[13]
    first = full.token_ids.index(stop_tok)
    cases = [
        (SamplingParams(temperature=0, max_tokens=11, ignore_eos=True), 11, "length"),
        (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]), first + 1, "stop"),
    ]
    word = base.tokenizer.decode([full.token_ids[17]])
    cut = full.text.index(word) if word in full.text else None
    for sp, n, reason in cases:
        out = llm.generate([p], sp)[0].outputs[0]
        assert out.token_ids == full.token_ids[:n] and out.finish_reason == reason
        assert llm.generate([p], sp)[0].usage.completion_tokens == n
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[word])
    out = llm.generate([p], sp)[0]
    ref = base.generate([p], sp)[0]
    assert out.outputs[0].text == ref.outputs[0].text == full.text[:cut]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


# ---- the KV pool ------------------------------------------------------------------------------
def _assert_pool_idle(llm, finals: list[list[int]], block_size: int = 4) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    st = kv.stats()
    assert st.in_use == 0 and st.free + st.cached == st.total
    chunks = {tuple(t[i:i + block_size]) for t in finals for i in range(0, len(t) - block_size + 1, block_size)}
    for block in kv.pool.created:   # the blocks ever handed out
        if block.block_hash is not None:   # only verified tokens are ever registered
            assert block.token_ids in chunks, block.token_ids


# small_draft@self: the target as its own draft, so every draft is accepted (long accepted runs
# through preemptions); small_draft: a random draft, nearly every draft rejected.
@pytest.mark.parametrize("mode", ["ngram", "small_draft", "small_draft@self"])
def test_pool_back_to_baseline_after_rejections_cancellations_and_preemptions(tiny, folder, mode):
    mode, _, own = mode.partition("@")
    draft = tiny if own else load_model(str(folder))
    if not own:
        with torch.no_grad():   # a random draft of the same vocabulary: nearly every draft is rejected
            g = torch.Generator().manual_seed(11)
            for prm in draft.model.parameters():
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    kw = dict(draft_loaded=draft) if mode == "small_draft" else {}
    # 24 blocks of 4 tokens for four requests that each grow to ~50 tokens: preemptions.
    llm = _spec(tiny, mode, folder, max_total_tokens=96, spec_max_batch_size=8, **kw)
    ref = LLM(loaded=tiny, device="cpu", block_size=4, max_total_tokens=96)
    prompts = [prompt(10) + " w3 w4 w3 w4", prompt(14), "w1 w2 " * 6, prompt(8)]
    sp = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    got = llm.generate(prompts, sp)
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in ref.generate(prompts, sp)]
    assert llm.engine.scheduler.num_preemptions > 0
    drafted, accepted = sum(r.usage.draft_tokens for r in got), sum(r.usage.accepted_tokens for r in got)
    assert drafted > 0 and (accepted == drafted if own else accepted < drafted)
    finals = [r.prompt_token_ids + r.outputs[0].token_ids for r in got]
    _assert_pool_idle(llm, finals)
    core = llm.engine   # cancellations mid-run, drafts outstanding
    for i, p in enumerate(prompts):
        core.add_request(f"c{i}", p, SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, seed=i))
    for _ in range(6):
        core.step()
    assert any(r.spec_token_ids for r in core.scheduler.running) or mode == "ngram"
    core.abort_request([f"c{i}" for i in range(len(prompts))])
    while core.has_unfinished_requests():
        core.step()
    core.kv.check_invariants()
    assert core.kv.stats().in_use == 0
