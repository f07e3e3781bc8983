"""Pearson chi-square goodness of fit, for the sampling tests."""
from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of ``counts`` (draws per category) under ``probs``.

    Categories expected fewer than ``min_expected`` times are pooled into one bin (dropped if
    the pool is still that small) so that the chi-square approximation holds. Categories with
    probability 0 must be checked separately by the caller (any draw there is a plain failure).
    """
    counts, probs = counts.double().cpu(), probs.double().cpu()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    if expected[~big].sum() >= min_expected:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_t, exp_t = torch.stack(obs), torch.stack(exp)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    dof = len(obs) - 1
    if dof < 1:
        raise ValueError("chi_square_pvalue: need at least two categories with enough expected draws")
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
