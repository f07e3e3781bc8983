"""The fused sampling kernel: greedy and top-k=1 are exact argmax; seeded draws repeat; filtered
tokens are never drawn; draws follow the reference distribution (chi-square); the filters are
sequential (top-p renormalised over the top-k survivors), and the kernel's reference keeps
exactly the tokens that ``engine.sampler``'s mask functions keep, on random inputs with ties.

Chi-square tests use fixed seeds, so they are deterministic; were the seeds random, a correct
kernel would fail each with probability 1e-3 (the p-value threshold).
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.sampler import apply_min_p, apply_top_k, apply_top_p
from sluice.kernels.sampling import sample, sample_ref, sampling_probs_ref
from tests.kernels.stats import chi_square_pvalue

P_MIN = 1e-3


def _params(rows, device, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, offset=0):
    f = lambda v, dt: torch.full((rows,), v, dtype=dt, device=device)  # noqa: E731
    return {"temperature": f(temperature, torch.float32), "top_k": f(top_k, torch.int32),
            "top_p": f(top_p, torch.float32), "min_p": f(min_p, torch.float32),
            "seeds": torch.arange(rows, dtype=torch.int64, device=device) * 7919 + 1,
            "offsets": f(offset, torch.int64)}


def test_greedy_and_top_k_1_are_argmax(device):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(device)
    expected = logits.argmax(-1)
    p = _params(6, device, temperature=0.0)
    assert torch.equal(sample(logits, **p), expected)
    p = _params(6, device, temperature=1.3, top_k=1)
    assert torch.equal(sample(logits, **p), expected)
    assert torch.equal(sample_ref(logits, **p), expected)


def test_greedy_ties_take_the_lowest_index_across_tiles(device):
    logits = torch.zeros(1, 5000, device=device)     # spans two 4096-wide tiles
    logits[0, [4500, 4100]] = 3.0
    assert sample(logits, **_params(1, device, temperature=0.0)).tolist() == [4100]


def test_seeded_rows_repeat_and_offsets_change_draws(device):
    logits = torch.zeros(8, 50, device=device)
    a = sample(logits, **_params(8, device))
    assert torch.equal(a, sample(logits, **_params(8, device)))
    assert not torch.equal(a, sample(logits, **_params(8, device, offset=1)))


# Draws per case. The interpreter runs one program per row (~15 ms each here), so rows are the
# cost. The distribution logic is the same for every dtype (each pass converts the tile it loads
# to fp32), so fp32 keeps the 400 draws whose chi-square catches the distribution bugs: a
# one-place shift of the inverse CDF (power 1.0 in both cases), uniform draws over the right
# survivors (0.996 / 0.85), ignoring temperature (1.0 in the second case), any filter dropped or
# off by one (the zero-count check, 1.0). What can go wrong for fp16/bf16 alone is the loads
# (conversion, masking, addressing), and a wrong load moves the distribution grossly: 100 draws
# still catch the shift (0.93 / 0.80) and every filtered token drawn (1.0). (Power at
# p = 1e-3 from the non-central chi-square, against each bug's own distribution.)
ROWS = {torch.float32: 400, torch.float16: 100, torch.bfloat16: 100}


@pytest.mark.parametrize("filters", [
    {"temperature": 0.7, "top_k": 4},
    {"temperature": 1.5, "min_p": 0.1, "top_k": 6, "top_p": 0.8},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_draws_follow_reference_distribution(device, filters, dtype):
    rows, vocab = ROWS[dtype], 12
    base = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    base = (base * 8).round() / 8                      # exact in fp16 and bf16 too
    logits = base.repeat(rows, 1).to(device=device, dtype=dtype)
    p = _params(rows, device, **filters)
    tokens = sample(logits, **p)
    probs = sampling_probs_ref(logits[:1].float(), p["temperature"][:1], p["top_k"][:1], p["top_p"][:1],
                               p["min_p"][:1])[0]
    counts = torch.bincount(tokens, minlength=vocab).cpu()
    assert counts[probs.cpu() == 0].sum() == 0, "a filtered-out token was drawn"
    assert (probs > 0).sum() >= 2, "the filters must leave a real choice for this test to mean something"
    assert chi_square_pvalue(counts, probs) > P_MIN


def test_reference_filters_on_a_known_distribution():
    # weights ∝ [8, 4, 2, 1, 1] / 16: top-p 0.7 keeps tokens whose heavier mass is < 0.7: {0, 1} (token 2: 0.75)
    logits = torch.log(torch.tensor([[8.0, 4.0, 2.0, 1.0, 1.0]]))
    one = lambda v, dt: torch.tensor([v], dtype=dt)  # noqa: E731
    probs = sampling_probs_ref(logits, one(1.0, torch.float32), one(0, torch.int32), one(0.7, torch.float32),
                               one(0.0, torch.float32))
    torch.testing.assert_close(probs, torch.tensor([[8 / 12, 4 / 12, 0, 0, 0]]))
    probs = sampling_probs_ref(logits, one(1.0, torch.float32), one(4, torch.int32), one(1.0, torch.float32),
                               one(0.0, torch.float32))   # top-4 keeps the tie at the 4th place
    torch.testing.assert_close(probs, torch.tensor([[8 / 16, 4 / 16, 2 / 16, 1 / 16, 1 / 16]]))
    probs = sampling_probs_ref(logits, one(1.0, torch.float32), one(0, torch.int32), one(1.0, torch.float32),
                               one(0.25, torch.float32))  # min-p: weight >= 2
    torch.testing.assert_close(probs, torch.tensor([[8 / 14, 4 / 14, 2 / 14, 0, 0]]))


def test_top_p_is_judged_on_the_top_k_survivors_renormalised(device):
    # weights ∝ [8, 4, 2, 1, 1]; top-k 3 keeps mass 14. Token 2's heavier mass is 12/14 = 0.857 >= 0.8:
    # dropped. (Judged on the full softmax it would be 12/16 = 0.75 < 0.8 and kept.) That bug draws
    # token 2 with probability 2/14: 100 rows all miss it with probability (6/7)^100 = 2e-7.
    rows = 100
    logits = torch.log(torch.tensor([[8.0, 4.0, 2.0, 1.0, 1.0]])).repeat(rows, 1).to(device)
    p = _params(rows, device, top_k=3, top_p=0.8)
    probs = sampling_probs_ref(logits[:1], p["temperature"][:1], p["top_k"][:1], p["top_p"][:1], p["min_p"][:1])
    torch.testing.assert_close(probs.cpu(), torch.tensor([[8 / 12, 4 / 12, 0.0, 0.0, 0.0]]))
    counts = torch.bincount(sample(logits, **p), minlength=5).cpu()
    assert counts[2:].sum() == 0, "a token outside top-p of the top-k survivors was drawn"
    assert chi_square_pvalue(counts, probs[0]) > P_MIN


def test_top_k_and_top_p_across_vocabulary_tiles_stay_in_the_support(device):
    rows, vocab = 16, 5000                                 # two 4096-wide tiles
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 2).to(device)
    p = _params(rows, device, top_k=50, top_p=0.8)   # keeps 23..34 of the top 50
    probs = sampling_probs_ref(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"])
    assert ((probs > 0).sum(-1) > 1).all(), "each row must keep a real choice"
    for offset in range(2):
        tokens = sample(logits, **{**p, "offsets": torch.full((rows,), offset, dtype=torch.int64, device=device)})
        assert (probs.gather(1, tokens[:, None]) > 0).all(), "a token outside the survivors was drawn"


def _engine_kept(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """[B, V] bool: the tokens engine.sampler's masks keep, in its order (top-k, top-p, min-p)."""
    x = logits / temperature[:, None]
    x = apply_top_p(apply_top_k(x, top_k.long()), top_p)
    return apply_min_p(x, min_p) != float("-inf")


def test_reference_keeps_what_the_engine_masks_keep():
    g = torch.Generator().manual_seed(11)
    rows, vocab = 400, 23
    # Half the rows on a coarse grid, so that ties straddle the thresholds.
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    logits[::2] = (logits[::2] * 2).round() / 2
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.3
    top_k = torch.randint(-1, vocab + 3, (rows,), generator=g, dtype=torch.int32)
    top_p = torch.rand(rows, generator=g) * 0.95 + 0.05
    top_p[torch.rand(rows, generator=g) < 0.2] = 1.0
    min_p = torch.where(torch.rand(rows, generator=g) < 0.3, torch.zeros(rows), torch.rand(rows, generator=g) * 0.3)
    probs = sampling_probs_ref(logits, temperature, top_k, top_p, min_p)
    kept = _engine_kept(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(probs > 0, kept)
    engine_probs = (logits / temperature[:, None]).masked_fill(~kept, float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, engine_probs)
    # The case mix means something: some rows lose tokens to each filter alone.
    assert (kept.sum(-1) < vocab).sum() > rows // 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(device, dtype):
    logits = torch.randn(4, 1000, device=device).to(dtype)
    assert torch.equal(sample(logits, **_params(4, device, temperature=0.0)), logits.float().argmax(-1))


@pytest.mark.parametrize("name,bad,message", [
    ("logits", torch.zeros(2, 5, dtype=torch.int64), "logits: dtype must be one of"),
    ("top_k", torch.zeros(2, dtype=torch.int64), "top_k: dtype must be one of \\(int32\\)"),
    ("seeds", torch.zeros(3, dtype=torch.int64), "seeds: expected shape \\(2,\\)"),
    ("temperature", torch.zeros(2, 1), "temperature: must have 1 dims"),
])
def test_sample_rejects_bad_arguments(name, bad, message):
    args = {"logits": torch.zeros(2, 5), **_params(2, "cpu")}
    args[name] = bad
    with pytest.raises(ValueError, match=message):
        sample(**args)
