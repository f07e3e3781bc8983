"""The grammar-mask sampling stage: every token a row's bitmask forbids gets -inf, in place.

A bitmask row holds ``ceil(V / 32)`` int32 words; bit ``j`` of word ``w`` (least significant
first) allows token ``32 * w + j`` (xgrammar's layout, which its matchers fill directly). An
all-ones row (-1 in every word) allows everything and leaves its logits untouched. The torch
reference ``apply_token_bitmask_ref`` defines the result; the engine's CPU path is the same
computation (``engine.structured.bitmask``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FLOAT_DTYPES, check_tensor, next_pow2

# Tuning: one program per (row, 4096-token vocabulary tile): 128 words of mask, 16 KB of fp32.
_BLOCK_V = 4096
_NUM_WARPS = 4


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr, bitmask_ptr, stride_logits_row, stride_mask_row, vocab_size,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)       # [BLOCK_V]
    in_vocab = cols < vocab_size
    words = tl.load(bitmask_ptr + row * stride_mask_row + cols // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_logits_row + cols
    # Only forbidden positions are written: a row (or tile) the grammar leaves open costs a read.
    tl.store(ptrs, tl.full([BLOCK_V], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    check_tensor("bitmask", bitmask, 2, (torch.int32,), logits.device)
    rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if tuple(bitmask.shape) != (rows, words):
        raise ValueError(f"bitmask: expected shape ({rows}, {words}), got {tuple(bitmask.shape)}")
    for name, t in (("logits", logits), ("bitmask", bitmask)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")


def apply_token_bitmask(
    logits: torch.Tensor,     # [num_rows, vocab_size] fp32/fp16/bf16, modified in place
    bitmask: torch.Tensor,    # [num_rows, ceil(vocab_size / 32)] int32
) -> torch.Tensor:
    _check(logits, bitmask)
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits
    block_v = min(_BLOCK_V, max(32, next_pow2(vocab)))
    _apply_bitmask_kernel[(rows, triton.cdiv(vocab, block_v))](
        logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK_V=block_v, num_warps=_NUM_WARPS)
    return logits


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The same result in torch (in place, like the kernel)."""
    _check(logits, bitmask)
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(rows, -1)[:, :vocab].bool()
    return logits.masked_fill_(~allowed, float("-inf"))
