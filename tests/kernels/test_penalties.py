"""apply_penalties (repetition, frequency, presence, logit bias) equals its torch reference and
the hand-computed values of a small example, also with stride-0 (expanded) history tables and
the sampler's (0, +0.0) bias padding."""
from __future__ import annotations

import pytest
import torch

from sluice.kernels.penalties import apply_penalties, apply_penalties_ref


def _args(rows, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32)
    prompt = torch.rand(rows, vocab, generator=g) < 0.2
    bias_ids = torch.full((rows, 3), -1, dtype=torch.int32)
    bias_ids[0, :2] = torch.tensor([1, vocab - 1])
    bias_ids[1, 0] = 2
    return [t.to(device) for t in (
        counts, prompt, torch.rand(rows, generator=g), torch.rand(rows, generator=g),
        torch.rand(rows, generator=g) + 0.5, bias_ids, torch.randn(rows, 3, generator=g))]


@pytest.mark.parametrize("vocab", [7, 2500])   # one partial tile; several tiles
def test_penalties_match_reference(device, vocab):
    args = _args(3, vocab, device)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)).to(device)
    got = apply_penalties(logits.clone(), *args)
    torch.testing.assert_close(got, apply_penalties_ref(logits.clone(), *args), rtol=1e-6, atol=1e-6)


def test_penalties_known_values(device):
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]], device=device)
    counts = torch.tensor([[1, 0, 2, 0]], dtype=torch.int32, device=device)
    prompt = torch.tensor([[False, True, False, False]], device=device)
    f = lambda v: torch.tensor([v], device=device)  # noqa: E731
    ids = torch.tensor([[3]], dtype=torch.int32, device=device)
    out = apply_penalties(logits, counts, prompt, f(0.5), f(0.25), f(2.0), ids, f([10.0])[None, 0:1].reshape(1, 1))
    # token 0: 2/2 - 0.25 - 0.5; token 1 (prompt): -2*2; token 2: 1/2 - 0.5 - 0.5; token 3: 0.5 + 10
    torch.testing.assert_close(out, torch.tensor([[0.25, -4.0, -0.5, 10.5]], device=device))


def test_expanded_tables_and_zero_value_padding(device):
    rows, vocab = 3, 9
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(device)
    counts = torch.zeros(1, vocab, dtype=torch.int32, device=device).expand(rows, vocab)
    prompt = torch.zeros(1, vocab, dtype=torch.bool, device=device).expand(rows, vocab)
    f = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    ids = torch.tensor([[4, 0], [0, 0], [7, 3]], dtype=torch.int32, device=device)
    vals = f([1.5, 0.0], [0.0, 0.0], [-2.0, 0.25])
    zeros, ones = f(0.0, 0.0, 0.0), f(1.0, 1.0, 1.0)
    out = apply_penalties(logits.clone(), counts, prompt, zeros, zeros, ones, ids, vals)
    expected = logits.clone()
    expected[0, 4] += 1.5
    expected[2, 7] -= 2.0
    expected[2, 3] += 0.25
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_penalties_half_precision(device, dtype):
    args = _args(2, 300, device)
    logits = torch.randn(2, 300, device=device).to(dtype)
    got = apply_penalties(logits.clone(), *args)
    torch.testing.assert_close(got, apply_penalties_ref(logits.clone(), *args))


def test_penalties_reject_bad_arguments():
    args = _args(2, 5, "cpu")
    with pytest.raises(ValueError, match="output_counts: dtype must be one of \\(int32\\)"):
        apply_penalties(torch.zeros(2, 5), args[0].long(), *args[1:])
    with pytest.raises(ValueError, match="prompt_mask: expected shape \\(2, 5\\)"):
        apply_penalties(torch.zeros(2, 5), args[0], args[1][:, :4], *args[2:])
    with pytest.raises(ValueError, match="bias_values: expected shape"):
        apply_penalties(torch.zeros(2, 5), *args[:6], args[6][:, :2])
