"""A grammar that reaches a state no token of the vocabulary continues (here: a choice whose text
needs a space, which the tiny word-level tokenizer cannot spell after ``w5``) fails that request
alone with a clear error. Before, its row was masked to all -inf: NaN probabilities, token 0
sampled against the grammar (or, with drafts, NaN inside verification for the whole batch)."""
from __future__ import annotations

import pytest

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.tiny_model import prompt, write_tiny_folder

SPEC = GrammarSpec("choice", choices=("w5 w6", "w7"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(write_tiny_folder(tmp_path_factory.mktemp("dead_end") / "tiny")))


@pytest.mark.parametrize("mode", ["disable", "ngram"])
def test_a_dead_end_fails_only_its_own_request(tiny, mode):
    llm = LLM(loaded=tiny, device="cpu", block_size=4, max_total_tokens=2048, num_threads=1,
              speculative_mode=mode)
    outcomes = set()
    for seed in range(12):
        free = SamplingParams(max_tokens=30, temperature=0.8, seed=seed, ignore_eos=True)
        constrained = SamplingParams(max_tokens=10, temperature=0.8, seed=100 + seed, structured=SPEC)
        other, grammar = llm.generate([prompt(30), prompt(3 + seed)], [free, constrained])
        assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 30
        out = grammar.outputs[0]
        if out.finish_reason == "error":
            assert "no token of the model's vocabulary can continue" in out.error, out.error
            assert out.token_ids[-1:] == [5]          # w5, after which nothing can follow
            outcomes.add("dead end")
        else:
            assert (out.finish_reason, out.token_ids) == ("stop", [7, 126]), out   # w7, <eos>
            outcomes.add("w7")
    assert outcomes == {"dead end", "w7"}     # both paths taken by these seeds
