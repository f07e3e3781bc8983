"""The whole engine (scheduler, paged KV cache, runner, sampler) against transformers.

Eight prompts of different lengths run together in one batch and must equal transformers'
greedy continuation token for token for 32 tokens: with the default token budget, with chunked
prefill forced to 7-token chunks, when a second run hits the prefix cache, and when the KV pool
is too small for all requests at once (preemption by recompute). Afterwards every block is
back in the pool.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a small dragon who",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "The three primary colours are red, yellow and blue. Mixing red and blue gives you",
    "東京は日本の",
    "Here is a list of fruits:\n- apple\n- banana\n-",
]


@pytest.fixture(scope="module")
def loaded(smollm2):
    return smollm2


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def first_run(loaded):
    """(engine, results) of the prompts on a fresh engine with the default options: the first
    half of test_batched_greedy_equals_transformers_and_prefix_hit, and hf_greedy's guesses."""
    llm = LLM(loaded=loaded)
    return llm, llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def hf_greedy(smollm2, hf_smollm2, first_run):
    """transformers' greedy continuation of each prompt (no EOS stop), NEW_TOKENS long.

    Checked rather than generated: our first run's tokens are only a guess, which one
    transformers forward over prompt + guess confirms when every guessed token is transformers'
    argmax after the tokens before it. That is the definition of its greedy continuation (by
    induction from the first token), so a confirmed guess is exactly what 32 one-token steps
    would give; it costs 8 forwards instead of 256 (about 2 s against 14 s here). A guess that is
    wrong anywhere is thrown away and transformers generates that prompt itself
    (``hf_smollm2.greedy``, tests/model/conftest.py), so our engine never grades itself."""
    guesses = [r.outputs[0].token_ids for r in first_run[1]]
    return [_confirmed_or_generated(hf_smollm2, smollm2.tokenizer.encode(p), guess)
            for p, guess in zip(PROMPTS, guesses)]


@torch.inference_mode()
def _confirmed_or_generated(oracle, ids: list[int], guess: list[int]) -> list[int]:
    if len(guess) == NEW_TOKENS:
        # Not oracle.logits: its memo would keep 8 x [~60, vocab] float32 for the session.
        logits = oracle.model(torch.tensor([ids + guess[:-1]]), use_cache=False).logits[0]   # [T, vocab]
        if logits[len(ids) - 1:].argmax(-1).tolist() == guess:
            return list(guess)
    return oracle.greedy(ids, NEW_TOKENS)


def _assert_idle(llm: LLM) -> None:
    llm.engine.kv.check_invariants()
    stats = llm.engine.get_load()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_used == 0


def _tokens(results):
    return [r.outputs[0].token_ids for r in results]


def test_batched_greedy_equals_transformers_and_prefix_hit(first_run, hf_greedy):
    llm, first = first_run
    assert _tokens(first) == hf_greedy
    assert all(r.usage.cached_tokens == 0 for r in first)
    _assert_idle(llm)
    # Same prompts again: every full block of each prompt comes from the prefix cache.
    second = llm.generate(PROMPTS, GREEDY)
    assert _tokens(second) == hf_greedy
    block = llm.engine.config.cache.block_size
    for r in second:
        n = len(r.prompt_token_ids)
        assert r.usage.cached_tokens == ((n - 1) // block) * block
    assert sum(r.usage.cached_tokens for r in second) > 0
    assert llm.engine.kv.prefix_cache_hit_rate > 0
    _assert_idle(llm)


def test_chunked_prefill_in_seven_token_chunks(loaded, hf_greedy):
    llm = LLM(loaded=loaded, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy
    _assert_idle(llm)


def test_preemption_with_a_small_pool(loaded, hf_greedy):
    # 40 blocks of 4 tokens: room for three of the eight sequences (up to 17 + 32 tokens, 13
    # blocks), so the rest wait or are preempted and recomputed (6 preemptions), and must still
    # produce the same tokens. (20 blocks made 10 preemptions in 1.6x the time.)
    llm = LLM(loaded=loaded, block_size=4, max_total_tokens=160, enable_prefix_caching=False)
    results = llm.generate(PROMPTS, GREEDY)
    assert _tokens(results) == hf_greedy
    assert llm.engine.scheduler.stats().num_preemptions > 0
    _assert_idle(llm)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks
