"""Speculative sampling keeps the target distribution: on the tiny random-weight model, the
per-position distribution of sampled tokens with each proposer equals the one without
speculation (two-sample chi-square, fixed seeds), and the same test fails when the acceptance
rule is broken on purpose.

The set-up makes drafts matter: the prompt repeats a run the n-gram proposer copies, logit bias
makes that run likely (so drafts are accepted about as often as they are rejected), and a
frequency penalty makes each position's distribution depend on the tokens before it, drafts
included. small_draft runs with another random-weight model of the same vocabulary as its draft
(its drafts are sampled from its own distribution q, which the rejection rule compares with the
target's p), and with the target as its own draft, where q equals p: then every draft is
accepted, as the rule promises. eagle and medusa run with seeded random-weight heads (their
drafts are drawn from the heads' q, through the target's LM head).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.spec_decode import tree as tree_mod
from sluice.engine.spec_decode import verify as verify_mod
from sluice.engine.spec_decode.heads import EagleHead, MedusaHeads, eagle_config
from tests.tiny_model import write_tiny_folder

pytestmark = pytest.mark.timeout(600)
PROMPT = "w5 w6 w20 w21 w22 w7 w30 w5 w6"
POSITIONS = 4
# Samples per run: REQUESTS x CHOICES with speculation, BASELINE_REQUESTS x CHOICES without.
# The baseline is drawn once for the module and each of the seven speculative runs compares
# with it, so a large baseline and smaller speculative runs buy the same power for less time.
# A two-sample chi-square test's power is set by its noncentrality, about
# n_a n_b / (n_a + n_b) x sum_c (p_c - q_c)^2 / p_c: with 12000 and 2400 samples the factor is
# 2000, exactly as with 4000 and 4000, so every difference between the two distributions is
# found as surely as before, at 60% of each speculative run's samples (a speculative sample
# costs about four times a baseline one here: drafting and verifying). Categories below 5
# expected draws in the smaller sample are pooled: now those under 0.21%, before 0.125%.
REQUESTS, BASELINE_REQUESTS, CHOICES = 24, 120, 100
# One thread: on a shared 2-core machine two threads contend and every tiny op waits.
OPTS = dict(device="cpu", block_size=4, max_num_seqs=128, max_total_tokens=8192, num_threads=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(folder):
    return load_model(str(folder))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """(folder, loaded) of a different random model with the same tokenizer: a draft whose q is not p."""
    folder = write_tiny_folder(tmp_path_factory.mktemp("other"), seed=1)
    return folder, load_model(str(folder))


def _params() -> SamplingParams:
    return SamplingParams(n=CHOICES, temperature=1.0, top_k=5, max_tokens=POSITIONS, ignore_eos=True,
                          logit_bias={20: 4.0, 21: 4.0, 22: 4.0}, frequency_penalty=0.8)


def _sample(llm: LLM, requests: int = REQUESTS) -> list[Counter]:
    per_pos = [Counter() for _ in range(POSITIONS)]
    for res in llm.generate([PROMPT] * requests, _params()):
        for out in res.outputs:
            assert len(out.token_ids) == POSITIONS
            for j, t in enumerate(out.token_ids):
                per_pos[j][t] += 1
    return per_pos


def two_sample_pvalue(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples come from one distribution (a 2 x C table); categories
    expected fewer than ``min_expected`` times in either sample are pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    share = min(na, nb) / (na + nb)
    cells, pool = [], [0, 0]
    for c in set(a) | set(b):
        if (a[c] + b[c]) * share >= min_expected:
            cells.append((a[c], b[c]))
        else:
            pool[0] += a[c]
            pool[1] += b[c]
    if sum(pool) * share >= min_expected:
        cells.append(tuple(pool))
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    dof = len(cells) - 1
    assert dof >= 1, "too few categories for a chi-square test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def baseline(tiny):
    return _sample(LLM(loaded=tiny, seed=1, **OPTS), BASELINE_REQUESTS)


def random_heads(tiny, mode: str, scale: float = 0.1, seed: int = 0):
    """Medusa (4 heads of one block, the target's LM head) or EAGLE heads with N(0, scale^2)
    weights (norms 1). The scale keeps the acceptance rate inside the window below: the heads'
    output stays near the target's hidden state, so the logit bias and top_k pull q onto the
    target's likely tokens too (at 0.1: medusa 0.30, eagle 0.23). At 0.3 EAGLE's layer swamps it and
    its drafts land where the target rarely samples (acceptance about 0.001): the test would
    then check little more than the residual distribution."""
    g = torch.Generator().manual_seed(seed)
    if mode == "medusa":
        heads = MedusaHeads(tiny.arch.hidden_size, 4, 1)
    else:
        heads = EagleHead(ModelArchConfig.from_hf_config(eagle_config(tiny.arch)))
    with torch.no_grad():
        for name, prm in heads.named_parameters():
            if "layernorm" not in name:
                prm.copy_(torch.randn(prm.shape, generator=g) * scale)
    return heads


def _spec(tiny, folder, mode: str, draft=None, min_prob: float = 0.0, tree: bool = False) -> LLM:
    kw = {}
    if mode == "small_draft":
        draft_folder, draft_loaded = draft or (folder, tiny)
        kw = dict(additional_models=str(draft_folder), draft_loaded=draft_loaded)
    elif mode in ("eagle", "medusa"):
        # Chains: drafts drawn from the heads' q. Trees (width 3): each node's likeliest children,
        # point masses verified by elimination.
        kw = dict(additional_models=f"random {mode} heads", heads=random_heads(tiny, mode),
                  spec_min_draft_prob=min_prob, spec_tree_width=3 if tree else 1)
    return LLM(loaded=tiny, seed=2, speculative_mode=mode, spec_draft_length=4,
               spec_max_batch_size=1024, **OPTS, **kw)


# eagle@0.05: drafts end at the head's first token under 5% (spec_min_draft_prob), which depends
# on the drafts drawn; the target's distribution must survive that too. "tree": draft trees of
# width 3 (every node kept, or @0.05: paths of probability >= 5%).
@pytest.mark.parametrize("mode", ["ngram", "small_draft", "eagle", "medusa", "eagle@0.05", "eagle tree",
                                  "medusa tree", "eagle tree@0.05"])
def test_per_position_distribution_unchanged(tiny, folder, other, baseline, mode, monkeypatch):
    mode, _, min_prob = mode.partition("@")
    mode, _, tree = mode.partition(" ")
    branches = []
    inner = tree_mod.accepted_moves
    monkeypatch.setattr(tree_mod, "accepted_moves", lambda nodes: branches.append(nodes[:1] not in ([], [0])) or inner(nodes))
    llm = _spec(tiny, folder, mode, draft=other, min_prob=float(min_prob or 0), tree=bool(tree))
    got = _sample(llm)
    stats = llm.engine.spec.stats
    # Drafts were both accepted and rejected often enough for the test to mean something (for
    # trees: per step, a tree holding up to 12 nodes; and through later children too).
    rate = stats.num_accepted_tokens / (stats.num_drafts * 4 if tree else stats.num_draft_tokens)
    assert 0.1 < rate < 0.9, rate
    assert (sum(branches) > 50) == bool(tree), sum(branches)
    if min_prob:   # some drafts were cut short, and some were not
        per_draft = stats.num_draft_tokens / stats.num_drafts
        assert 1 < per_draft < 4, per_draft
    pvalues = [two_sample_pvalue(baseline[j], got[j]) for j in range(POSITIONS)]
    assert min(pvalues) > 1e-3, pvalues


def test_the_target_as_its_own_sampled_draft_is_always_accepted(tiny, folder, baseline):
    llm = _spec(tiny, folder, "small_draft")
    got = _sample(llm)
    stats = llm.engine.spec.stats
    # q = p up to float rounding between the two runners' batches: min(1, p / q) is 1 or a hair under.
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens / stats.num_draft_tokens > 0.99
    pvalues = [two_sample_pvalue(baseline[j], got[j]) for j in range(POSITIONS)]
    assert min(pvalues) > 1e-3, pvalues


def _broken_rejection(probs, seqs, generators):
    """The bug this test exists for: after a rejection, draw from p instead of the residual
    max(0, p - q) (the rejected draft token can come back, so it is emitted too often)."""
    out = []
    for s in seqs:
        k = len(s.draft_ids)
        p = probs[s.first_row:s.first_row + k + 1]
        gen = generators.get(s.request)
        accepted = k
        for j, d in enumerate(s.draft_ids):
            if float(torch.rand((), generator=gen)) >= float(p[j, d]):
                accepted = j
                break
        last = int(torch.multinomial(p[accepted], 1, generator=gen)[0])
        out.append(s.draft_ids[:accepted] + [last])
    return out


def _broken_tree_rejection(probs, s, generators):
    """The tree rule's bug: a rejected child's token stays in p for its siblings and the draw
    after them (it is emitted too often)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(s.parents):
        children.setdefault(parent, []).append(i)
    gen = generators.get(s.request)
    accepted, node = [], -1
    while True:
        p = probs[s.first_row + (0 if node < 0 else 1 + node)]
        for child in children.get(node, ()):
            if float(torch.rand((), generator=gen)) < float(p[s.draft_ids[child]]):
                accepted.append(child)
                node = child
                break
        else:
            last = int(torch.multinomial(p, 1, generator=gen)[0])
            return accepted, [s.draft_ids[a] for a in accepted] + [last]


def test_the_test_fails_with_a_broken_tree_rule(tiny, folder, baseline, monkeypatch):
    monkeypatch.setattr(verify_mod, "_tree_rejection", _broken_tree_rejection)
    got = _sample(_spec(tiny, folder, "eagle", tree=True))
    pvalues = [two_sample_pvalue(baseline[j], got[j]) for j in range(POSITIONS)]
    assert min(pvalues) < 1e-6, pvalues


def test_the_test_fails_with_a_broken_acceptance_rule(tiny, folder, baseline, monkeypatch):
    monkeypatch.setattr(verify_mod, "_rejection_torch", _broken_rejection)
    # The same sample sizes as the tests above, so this shows what they can catch (measured:
    # smallest p-value 9e-24 with 2400 against 12000 samples).
    got = _sample(_spec(tiny, folder, "ngram"))
    pvalues = [two_sample_pvalue(baseline[j], got[j]) for j in range(POSITIONS)]
    assert min(pvalues) < 1e-6, pvalues
