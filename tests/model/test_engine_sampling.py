"""Sampling through the whole engine: seeded requests are reproducible whatever shares their
batch, ``n > 1`` choices share their prompt's KV blocks, and logprobs/stop strings/min_tokens
behave as documented."""
from __future__ import annotations

import math

import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(loaded=smollm2)


def test_seeded_request_same_alone_and_in_a_mixed_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(["Tell me about the moon."], seeded)[0].outputs[0].token_ids
    others = ["Write a poem about cats.", "List prime numbers:", "Hello there!"]
    mixed = llm.generate(
        others[:2] + ["Tell me about the moon."] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=20),
         seeded, SamplingParams(temperature=0.7, top_k=5, max_tokens=8, seed=9)],
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=4321, ignore_eos=True)
    assert llm.generate(["Tell me about the moon."], other_seed)[0].outputs[0].token_ids != alone


def test_parallel_choices_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = list(range(100, 140))          # 40 tokens: 2 full blocks of 16 + 8 in a third
    engine.add_request("par", prompt, SamplingParams(n=4, max_tokens=4, temperature=1.0, seed=5))
    engine.step()                           # everyone's prefill runs in this one step
    # Shared: the 2 full prompt blocks; private: each choice's partial third block.
    assert engine.get_load().kv_blocks_used == 2 + 4
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    texts = {d.index for o in outs for d in o.deltas}
    assert texts == {0, 1, 2, 3}
    assert engine.get_load().kv_blocks_used == 0


def test_logprobs_stop_strings_and_min_tokens(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    out = llm.generate(["The capital of France is"], sp)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 8
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == tok            # greedy: the chosen token is the best
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
    full = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[3:6]                        # a stop string somewhere inside the greedy continuation
    cut = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert short.finish_reason == "stop"    # greedy: the model ends its turn (24 tokens)...
    n = len(short.token_ids) + 3            # ...so min_tokens past that must hold the turn open
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n))[0].outputs[0]
    assert len(longer.token_ids) >= n
