"""apply_token_bitmask (the grammar-mask stage on CUDA) equals its torch reference and the
engine's CPU stage, and known values: forbidden tokens -inf, allowed ones untouched bit for bit,
all-ones rows untouched, vocabularies that end inside a word and span several tiles, bf16 logits;
bad shapes and dtypes are a ValueError naming the argument."""
from __future__ import annotations

import pytest
import torch

from sluice.engine.structured.bitmask import apply_bitmask
from sluice.kernels.bitmask import apply_token_bitmask, apply_token_bitmask_ref


def _mask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    m[0] = -1                                     # an unconstrained row
    return m


@pytest.mark.parametrize("vocab", [5, 70, 9000])   # inside one word; a partial word; several tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_matches_reference_and_engine_stage(device, vocab, dtype):
    rows = 3
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = _mask(rows, vocab, seed=vocab)
    want = apply_token_bitmask_ref(logits.clone(), mask)
    assert torch.equal(want, apply_bitmask(logits, mask))
    got = apply_token_bitmask(logits.to(device).clone(), mask.to(device)).cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[0], logits[0])          # all ones: untouched
    assert torch.isinf(got[1:]).any() and torch.isfinite(got[1:]).any()


def test_bitmask_known_values(device):
    logits = torch.arange(40, dtype=torch.float32).reshape(1, 40).to(device)
    mask = torch.tensor([[0b101, 0b10]], dtype=torch.int32, device=device)   # tokens 0, 2 and 33
    out = apply_token_bitmask(logits, mask).cpu()[0]
    assert [i for i in range(40) if torch.isfinite(out[i])] == [0, 2, 33]
    assert out[0] == 0 and out[2] == 2 and out[33] == 33


@pytest.mark.parametrize("logits, mask, message", [
    (torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32), r"bitmask: expected shape \(2, 2\)"),
    (torch.zeros(2, 40), torch.zeros(2, 2, dtype=torch.int64), "bitmask: dtype must be one of"),
    (torch.zeros(2, 40, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), "logits: dtype must be one of"),
])
def test_bitmask_bad_arguments(logits, mask, message):
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask(logits, mask)
