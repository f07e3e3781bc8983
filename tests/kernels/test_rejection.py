"""Speculative-decoding rejection sampling: emitted tokens follow the target distribution
(chi-square, for a fixed draft distribution that differs from it), p == q accepts everything
plus a bonus token, p = 0 at a draft token rejects there, and the reference agrees.

Chi-square tests use fixed seeds (deterministic); with random seeds a correct sampler would
fail each with probability 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from sluice.kernels.rejection import rejection_sample, rejection_sample_ref
from tests.kernels.stats import chi_square_pvalue

P_MIN = 1e-3


def _fixed_draft_case(rows, vocab, k, device):
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(1, k + 1, vocab, generator=g) * 1.5, -1).repeat(rows, 1, 1)
    q = torch.softmax(torch.randn(1, k, vocab, generator=g) * 1.5, -1).repeat(rows, 1, 1)
    drafts = torch.stack([torch.multinomial(q[:, j], 1, generator=g)[:, 0] for j in range(k)], 1)
    return drafts.to(device), q.to(device), p.to(device)


def _assert_first_token_law(out, emitted, drafts, q, p) -> None:
    """The first emitted token follows the target p (chi-square). Also exactly: a row that kept its
    first draft emitted it, and a row that emitted one token rejected it and resampled from the
    residual max(0, p - q), so never a token outside that residual's support."""
    first = out[:, 0].cpu()
    assert chi_square_pvalue(torch.bincount(first, minlength=p.shape[-1]), p[0, 0].cpu()) > P_MIN
    rejected = (emitted == 1).cpu()
    kept = ~rejected
    assert torch.equal(first[kept], drafts[:, 0].cpu()[kept])
    residual = (p[0, 0] - q[0, 0]).clamp(min=0).cpu()
    assert rejected.sum() > len(first) // 2, "the case must reject most first drafts to test the residual"
    assert (residual[first[rejected]] > 0).all(), "a rejected draft was resampled outside max(0, p - q)"


def test_first_token_follows_target_distribution(device):
    # 200 rows (the interpreter runs one ~20 ms program per row). The subtlest bug, resampling a
    # rejected draft from p instead of the residual, leaves the first token's marginal close to p
    # (chi-square power 0.91 at 200 rows, 1.0 at 600) but puts 18% of the ~160 rejected rows
    # outside the residual's support, which the exact check catches with probability 1 - 2e-14.
    # Always accepting, or an inverted ratio q/p, fail the chi-square alone (power 1.0).
    rows, vocab = 200, 6
    drafts, q, p = _fixed_draft_case(rows, vocab, 2, device)
    out, emitted = rejection_sample(drafts, q, p, torch.arange(rows, device=device),
                                    torch.zeros(rows, dtype=torch.int64, device=device))
    assert ((emitted >= 1) & (emitted <= 3)).all()
    pos = torch.arange(3, device=device)[None, :]
    assert torch.equal(out >= 0, pos < emitted[:, None].long()), "tokens then -1 padding"
    _assert_first_token_law(out, emitted, drafts, q, p)
    # The reference sampler satisfies the same law.
    ref, ref_emitted = rejection_sample_ref(drafts.cpu(), q.cpu(), p.cpu(), torch.Generator().manual_seed(0))
    _assert_first_token_law(ref, ref_emitted, drafts.cpu(), q.cpu(), p.cpu())


def test_equal_distributions_accept_all_and_add_bonus(device):
    drafts, q, p = _fixed_draft_case(5, 9, 3, device)
    p[:, :3] = q
    bonus_only = torch.zeros_like(p[:, 3])
    bonus_only[:, 4] = 1.0
    p[:, 3] = bonus_only
    out, emitted = rejection_sample(drafts, q, p, torch.arange(5, device=device), torch.zeros(5, dtype=torch.int64, device=device))
    assert emitted.tolist() == [4] * 5
    assert torch.equal(out[:, :3], drafts) and out[:, 3].tolist() == [4] * 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_target_probability_rejects_and_resamples_from_residual(device, dtype):
    drafts, q, p = _fixed_draft_case(4, 5, 2, device)
    rows = torch.arange(4, device=device)
    p[rows, 1] = 0.0
    p[rows, 1, (drafts[:, 1] + 1) % 5] = 1.0   # residual max(0, p - q) is one-hot here
    p[rows, 0] = q[rows, 0]
    q, p = q.to(dtype), p.to(dtype)
    out, emitted = rejection_sample(drafts, q, p, rows.long(), torch.zeros(4, dtype=torch.int64, device=device))
    assert emitted.tolist() == [2] * 4
    assert torch.equal(out[:, 0], drafts[:, 0])
    assert torch.equal(out[:, 1], (drafts[:, 1] + 1) % 5)
    assert out[:, 2].tolist() == [-1] * 4
    ref, ref_emitted = rejection_sample_ref(drafts, q, p, None)
    assert torch.equal(ref, out) and torch.equal(ref_emitted, emitted)


def test_rejection_sample_rejects_bad_arguments():
    drafts, q, p = _fixed_draft_case(2, 5, 2, "cpu")
    seeds = offsets = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_probs: expected shape \\(2, 3, 5\\)"):
        rejection_sample(drafts, q, p[:, :2], seeds, offsets)
    with pytest.raises(ValueError, match="draft_probs: expected shape"):
        rejection_sample(drafts, q[:, :1], p, seeds, offsets)
    with pytest.raises(ValueError, match="seeds: dtype must be one of \\(int64\\)"):
        rejection_sample(drafts, q, p, seeds.int(), offsets)
