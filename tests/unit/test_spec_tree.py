"""Draft trees (``spec_decode.tree``, ``spec_tree_width`` > 1) on the tiny random-weight model:
the tree helpers; greedy output with trees is token for token the output without speculation,
one request at a time and for 16 mixed concurrent requests, with branches other than the first
accepted (their K/V moved to the chain's slots), through the C++ layer stack and through the
Python layers with the torch backend; sampled requests get trees and grammar requests chains;
block formats keep chains by default; and a tree where the step cannot attend through one, or in
another mode, is refused before anything runs. (The Triton backend:
tests/kernels/test_engine_triton_e2e.py.) (Sampled trees keep the target's
distribution: tests/model/test_spec_decode_distribution.py; the pool and the proposer back to
baseline through preemptions and cancellations: tests/unit/test_spec_heads.py.)"""
from __future__ import annotations

import pytest

from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode import tree
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.structured import GrammarSpec
from tests.tiny_model import prompt
from tests.unit.test_spec_heads import (OPTS, _assert_same, _mixed, base, folder,  # noqa: F401
                                        heads_folders, single_requests_same_as, tiny)

pytestmark = pytest.mark.timeout(300)


def test_tree_helpers():
    parents = [-1, -1, 0, 0, 2, 1]
    assert tree.depths(parents) == [1, 1, 2, 2, 3, 2]
    assert tree.path(parents, 4) == [0, 2, 4] and tree.path(parents, 1) == [1]
    assert tree.visibility(parents)[4] == [1, 0, 1, 0, 1, 0] and tree.visibility(parents)[5] == [0, 1, 0, 0, 0, 1]
    drafts = [10, 11, 12, 13, 14, 15]
    # argmax per row: the last known token's, then node i's at 1 + i.
    assert tree.accept_greedy([11, 0, 15, 0, 0, 0, 7], drafts, parents) == ([1, 5], 7)
    assert tree.accept_greedy([10, 13, 0, 0, 0, 0, 0], drafts, parents) == ([0, 3], 0)
    assert tree.accept_greedy([9] * 7, drafts, parents) == ([], 9)
    assert tree.accepted_moves([1, 5]) == [(1, 0), (5, 1)]
    assert tree.accepted_moves([0, 2, 4]) == [(2, 1), (4, 2)]
    assert tree.accepted_moves([0]) == []
    with pytest.raises(ValueError, match="node 1's parent 1 does not come before it"):
        tree.depths([-1, 1])


def _trees(tiny, heads_folders, monkeypatch, mode: str = "eagle", **kw) -> tuple[LLM, dict]:
    """An engine drafting full trees (width 3, every node kept and verified) that counts the
    accepted paths and the K/V moves they took."""
    seen = {"moves": 0, "branch": 0}
    inner = tree.accepted_moves

    def moves(accepted):
        out = inner(accepted)
        seen["moves"] += len(out)
        seen["branch"] += bool(accepted) and accepted[0] != 0
        return out

    monkeypatch.setattr(tree, "accepted_moves", moves)
    llm = LLM(loaded=tiny, speculative_mode=mode, additional_models=str(heads_folders[mode]),
              **(OPTS | dict(spec_max_batch_size=16, spec_min_draft_prob=0.0, spec_tree_width=3,
                             spec_tree_nodes=12) | kw))
    assert llm.engine.spec.max_drafts == 12 and llm.engine.spec.proposer.tree_width == 3
    return llm, seen


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_greedy_identical_with_trees_one_request_at_a_time(base, tiny, heads_folders, monkeypatch, mode):
    llm, seen = _trees(tiny, heads_folders, monkeypatch, mode)
    drafted, accepted = single_requests_same_as(llm, base)
    assert drafted > 4 * accepted > 0
    assert seen["branch"] > 0 and seen["moves"] > 0   # paths through later branches were accepted
    assert not getattr(llm.engine.spec.proposer, "_caches", {})


def test_a_tree_is_each_nodes_likeliest_children_up_to_k_times_width_nodes(tiny, heads_folders, monkeypatch):
    """Every node kept (threshold 0): the root's 3 children, then their 3 children each (K * W =
    12 nodes: the budget, r * W with room for r < K drafts), parents before children; and the
    default width on this stack is 3, with the tree threshold."""
    llm, _seen = _trees(tiny, heads_folders, monkeypatch)
    proposer = llm.engine.spec.proposer
    trees = []
    inner = proposer.propose
    proposer.propose = lambda requests, k: trees.extend(inner(requests, k).values()) or {}
    llm.generate([prompt(7)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert trees and all(d.parents[:3] == [-1, -1, -1] and set(d.parents[3:]) <= {0, 1, 2} for d in trees)
    full = [d for d in trees if len(d.token_ids) == 12]
    assert len(full) >= 3 and all(sorted(d.parents[3:]) == [0, 0, 0, 1, 1, 1, 2, 2, 2] for d in full)
    # Near max_tokens a request has room for fewer drafts (r), and so for r * 3 nodes.
    assert sorted(len(d.token_ids) for d in trees if d not in full) == [3, 6, 9]
    assert all(len(set(zip(d.parents, d.token_ids))) == len(d.token_ids) for d in trees)     # siblings differ
    for mode in ("eagle", "medusa"):    # float32 projections: trees by default
        auto = LLM(loaded=tiny, speculative_mode=mode, additional_models=str(heads_folders[mode]), **OPTS)
        assert auto.engine.spec.proposer.tree_width == 3 and auto.engine.spec.proposer.min_prob == 0.1
        assert auto.engine.scheduler.config.num_speculative_tokens == 12
        assert auto.engine.spec.proposer.tree_nodes == 5     # 6 rows at one row's cost on this stack


def test_a_step_verifies_the_best_scoring_nodes_and_the_others_that_pay_for_their_rows():
    """tree.select: the `free` nodes of highest path score, re-indexed in their order (ancestors
    included: a child never scores above its parent, ties go to the earlier node); then, best
    first, as many others as bring more (their scores) than the larger step costs (a jump, then
    a cost per row)."""
    tokens = [10, 11, 12, 13, 14, 15]
    parents = [-1, -1, 0, 0, 2, 1]
    scores = [0.6, 0.3, 0.6 * 0.5, 0.6 * 0.1, 0.3 * 0.9, 0.3 * 0.2]     # 0.6 .3 .3 .06 .27 .06
    assert tree.select(tokens, parents, scores, None) == (tokens, parents)
    assert tree.select(tokens, parents, scores, 6) == (tokens, parents)
    # Best 3: nodes 0 (0.6), 1 (0.3) and 2 (0.3: ties to the earlier); then 4 (0.27), 3 and 5 (0.06).
    assert tree.select(tokens, parents, scores, 3, step_cost=0.4, row_cost=0.0) == ([10, 11, 12], [-1, -1, 0])
    assert tree.select(tokens, parents, scores, 3, step_cost=0.3, row_cost=0.0) == (tokens, parents)
    assert tree.select(tokens, parents, scores, 3, step_cost=0.1, row_cost=0.1) == ([10, 11, 12, 14], [-1, -1, 0, 2])
    assert tree.select(tokens, parents, scores, 3) == ([10, 11, 12], [-1, -1, 0])    # 0.27 < 0.2 + 0.1
    assert (tree.EXTRA_ROWS_STEP_COST, tree.EXTRA_ROW_COST) == (0.2, 0.1)
    # A chain whose probabilities are all 1: its order is kept, parents first.
    assert tree.select([1, 2, 3], [-1, 0, 1], [1.0, 1.0, 1.0], 2, step_cost=2.0) == ([1, 2], [-1, 0])


def test_engine_trees_keep_at_most_the_free_nodes_when_the_rest_score_little(tiny, heads_folders):
    """The tiny model's random heads spread their probability thinly: with the default budget (5
    nodes on this stack) every verified tree is at most 5 nodes, its best-scoring ones."""
    llm = LLM(loaded=tiny, speculative_mode="eagle", additional_models=str(heads_folders["eagle"]),
              **(OPTS | dict(spec_min_draft_prob=0.0, spec_tree_width=3)))
    proposer = llm.engine.spec.proposer
    assert proposer.tree_nodes == 5
    trees, grown = [], []
    inner, inner_select = proposer.propose, tree.select

    def select(t, p, sc, free, **kw):
        grown.append((len(t), sorted(sc, reverse=True)[5:]))
        return inner_select(t, p, sc, free, **kw)

    proposer.propose = lambda requests, k: trees.extend(inner(requests, k).values()) or {}
    import sluice.engine.spec_decode.eagle as eagle_mod
    eagle_mod.tree.select, saved = select, eagle_mod.tree.select
    try:
        llm.generate([prompt(7)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        eagle_mod.tree.select = saved
    assert trees and any(n == 12 for n, _rest in grown)
    # No extra node pays for a larger step: even the best scores under the jump plus one row.
    assert all(not rest or rest[0] < tree.EXTRA_ROWS_STEP_COST + tree.EXTRA_ROW_COST for _n, rest in grown)
    assert all(len(d.token_ids) <= 5 for d in trees)
    assert all(-1 <= p < i for d in trees for i, p in enumerate(d.parents))


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_greedy_identical_with_trees_for_16_mixed_concurrent_requests(base, tiny, heads_folders, monkeypatch, mode):
    prompts, params = _mixed(base)
    llm, seen = _trees(tiny, heads_folders, monkeypatch, mode)
    _assert_same(llm.generate(prompts, params), base.generate(prompts, params))
    assert seen["branch"] > 0


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_sampled_requests_get_trees_and_grammar_requests_chains(tiny, heads_folders, monkeypatch, mode):
    llm, seen = _trees(tiny, heads_folders, monkeypatch, mode)
    proposer = llm.engine.spec.proposer
    shapes = []
    inner = proposer.propose

    def propose(requests, k):
        out = inner(requests, k)
        by_id = {r.request_id: r for r in requests}
        for rid, draft in out.items():
            params = by_id[rid].sampling_params
            shapes.append((params.temperature > 0, params.structured is not None, draft.parents is not None))
        return out

    proposer.propose = propose
    ps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=1, logit_bias={7: 4.0}),
          SamplingParams(temperature=0, max_tokens=10, structured=GrammarSpec("choice", choices=("w7",)))]
    got = llm.generate([prompt(6), prompt(9), prompt(4)], ps)
    assert got[2].outputs[0].token_ids[:1] == [7] and got[2].outputs[0].finish_reason == "stop"
    assert {(False, False, True), (True, False, True), (False, True, False)} <= set(shapes)
    assert all(is_tree != grammar for _sampled, grammar, is_tree in shapes)
    assert seen["moves"] + seen["branch"] > 0


@pytest.mark.parametrize("kw, message", [
    (dict(spec_tree_width=0), "spec_tree_width: must be an integer in \\[1, 8\\], got 0"),
    (dict(spec_tree_width=9), "spec_tree_width: must be an integer in \\[1, 8\\], got 9"),
    (dict(spec_tree_width=True), "spec_tree_width: must be an integer"),
    (dict(speculative_mode="ngram", additional_models=None, spec_tree_width=2), "eagle or medusa, not ngram"),
])
def test_bad_tree_widths_are_refused_before_anything_loads(kw, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**({"speculative_mode": "eagle", "additional_models": "heads"} | kw))


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_trees_through_the_python_layers_and_the_torch_backend_are_exact(folder, heads_folders, monkeypatch, mode):
    """Without the C++ layer stack the torch backend attends through a tree by index (its mask,
    ``TreeRows``): greedy output is still the output without speculation, branches accepted, and
    float32 gets trees by default there too."""
    monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")     # float32 through the Python layers
    loaded = load_model(str(folder))
    llm, seen = _trees(loaded, heads_folders, monkeypatch, mode)
    assert llm.engine.runner.model._cpu_decoder() is None
    drafted, accepted = single_requests_same_as(llm, LLM(loaded=loaded, **OPTS))
    assert drafted > 4 * accepted > 0 and seen["branch"] > 0 and seen["moves"] > 0
    auto = LLM(loaded=loaded, speculative_mode=mode, additional_models=str(heads_folders[mode]), **OPTS)
    assert auto.engine.spec.proposer.tree_width == 3


def test_a_tree_where_the_step_cannot_attend_through_one_is_refused_and_auto_is_a_chain(folder, heads_folders,
                                                                                      monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")     # the Python layers, whose backend says...
    monkeypatch.setattr(TorchAttentionBackend, "supports_trees", False)   # ...it cannot
    loaded = load_model(str(folder))
    with pytest.raises(ValueError, match="draft trees need a model and an attention backend that attend through "
                                         "them; this engine runs LlamaForCausalLM with attention 'torch'"):
        LLM(loaded=loaded, speculative_mode="eagle", additional_models=str(heads_folders["eagle"]),
            spec_tree_width=2, **OPTS)
    auto = LLM(loaded=loaded, speculative_mode="eagle", additional_models=str(heads_folders["eagle"]), **OPTS)
    assert auto.engine.spec.proposer.tree_width == 1 and auto.engine.spec.proposer.min_prob == 0.35
    assert auto.engine.scheduler.config.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="draft trees need a model and an attention backend"):
        LLM(loaded=loaded, speculative_mode="medusa", additional_models=str(heads_folders["medusa"]),
            spec_tree_width=3, **OPTS)


def test_block_formats_keep_chains_by_default_and_trees_stay_exact_on_them(folder, heads_folders, monkeypatch):
    """On w8a8 projections a tree's extra rows cost (integer products are compute-bound), so auto
    keeps chains; asked for, trees run on that stack with the same exactness."""
    loaded = load_model(str(folder), quantization="w8a8")
    auto = LLM(loaded=loaded, speculative_mode="eagle", additional_models=str(heads_folders["eagle"]), **OPTS)
    assert auto.engine.spec.proposer.tree_width == 1 and auto.engine.spec.proposer.min_prob == 0.35
    llm, seen = _trees(loaded, heads_folders, monkeypatch)
    ref = LLM(loaded=loaded, **OPTS)
    biased = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, logit_bias={7: 4.0})
    for p in ("w9 w9 w9 w9", prompt(11), prompt(4)):
        _assert_same(llm.generate([p], biased), ref.generate([p], biased))
    assert seen["branch"] > 0 and seen["moves"] > 0


def test_tree_children_over_the_draft_vocabulary_alone_are_those_of_the_full_softmax(tiny, tmp_path, monkeypatch):
    """With a draft vocabulary and nothing that changes logits, a tree's children come from a
    softmax and top-k over that vocabulary's logits alone: the same tokens and probabilities as
    over the whole vocabulary with -inf elsewhere. A row with a penalty takes the full path."""
    import torch

    from sluice.engine.request import Request
    from sluice.engine.sampler import GeneratorCache, SamplingBatch
    from sluice.engine.spec_decode import eagle
    from tests.tiny_model import HIDDEN, VOCAB
    from tests.unit.test_spec_heads import eagle_state, write_eagle

    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:VOCAB // 3]] = True
    heads = write_eagle(tmp_path / "eagle", eagle_state() | {"t2d": t2d})
    llm = LLM(loaded=tiny, speculative_mode="eagle", additional_models=str(heads),
              **(OPTS | dict(spec_tree_width=3, spec_head_format="float32")))
    proposer = llm.engine.spec.proposer
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4)) * 4
    with torch.inference_mode():
        want = torch.softmax(proposer._lm(h), dim=-1).topk(3, dim=-1)
    full_paths = []
    inner = eagle.penalize
    monkeypatch.setattr(eagle, "penalize", lambda logits, sb: full_paths.append(len(logits)) or inner(logits, sb))
    plain = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0)) for i in range(5)]
    with torch.inference_mode():
        ids, probs = proposer._top_children(h, SamplingBatch.from_requests(plain, VOCAB, "cpu", GeneratorCache()), 3)
    assert full_paths == [], "the plain rows did not take the draft-vocabulary path"
    assert ids == want.indices.tolist() and all(t2d[i] for row in ids for i in row)
    torch.testing.assert_close(torch.tensor(probs), want.values, rtol=1e-5, atol=1e-6)
    # A penalty, a bias or a min_tokens mask on one row: the whole vocabulary, penalised.
    for i, changes in enumerate((dict(repetition_penalty=1.5), dict(logit_bias={5: 3.0}), dict(min_tokens=4, stop_token_ids=[7]))):
        rows = plain[:4] + [Request("p", [1, 2, 3], SamplingParams(temperature=0.0, **changes))]
        with torch.inference_mode():
            ids2, _probs = proposer._top_children(h, SamplingBatch.from_requests(rows, VOCAB, "cpu",
                                                                                   GeneratorCache()), 3)
        assert full_paths == [5] * (i + 1) and ids2[:4] == ids[:4], changes
