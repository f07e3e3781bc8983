"""Penalties and logit bias, applied to the logits in place before sampling.

Per row, in this order (the reference ``apply_penalties_ref`` defines it):
  1. repetition (multiplicative, CTRL-style): for a token seen in the prompt or the output,
     a positive logit is divided by ``r`` and a negative one multiplied by ``r``;
  2. frequency and presence (additive, OpenAI-style), over the output tokens only:
     ``logit -= frequency * count + presence * (count > 0)``;
  3. logit bias: ``logit += bias`` for each listed token.
Token history arrives as dense per-row tables (counts of output tokens, a prompt mask; a table
no row needs may be a stride-0 ``expand`` of one zero row); biases as padded (id, value) lists,
where padding is id -1, or any id with the value +0.0 (``engine.sampler`` pads with (0, +0.0)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FLOAT_DTYPES, FP_FUSION, check_shape, check_tensor, next_pow2

# Tuning: one program per (row, 2048-token vocabulary tile).
_BLOCK_V = 2048
_NUM_WARPS = 4


@triton.jit
def _apply_penalties_kernel(
    logits_ptr, output_counts_ptr, prompt_mask_ptr, presence_ptr, frequency_ptr, repetition_ptr,
    bias_ids_ptr, bias_values_ptr,
    stride_logits_row, stride_counts_row, stride_mask_row, stride_bias_row,
    vocab_size, num_bias,
    BLOCK_V: tl.constexpr, BIAS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)     # [BLOCK_V]
    in_vocab = cols < vocab_size
    x = tl.load(logits_ptr + row * stride_logits_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
    count = tl.load(output_counts_ptr + row * stride_counts_row + cols, mask=in_vocab, other=0)
    in_prompt = tl.load(prompt_mask_ptr + row * stride_mask_row + cols, mask=in_vocab, other=0)
    rep = tl.load(repetition_ptr + row)
    seen = (count > 0) | (in_prompt != 0)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x -= tl.load(frequency_ptr + row) * count.to(tl.float32)
    x -= tl.load(presence_ptr + row) * (count > 0).to(tl.float32)

    b = tl.arange(0, BIAS_PAD)                                     # [BIAS_PAD]
    b_mask = b < num_bias
    b_ids = tl.load(bias_ids_ptr + row * stride_bias_row + b, mask=b_mask, other=-1)
    b_vals = tl.load(bias_values_ptr + row * stride_bias_row + b, mask=b_mask, other=0.0)
    match = cols[:, None] == b_ids[None, :]                        # [BLOCK_V, BIAS_PAD]
    x += tl.sum(tl.where(match, b_vals[None, :], 0.0), 1)
    tl.store(logits_ptr + row * stride_logits_row + cols, x.to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _check(logits, output_counts, prompt_mask, presence, frequency, repetition, bias_ids, bias_values) -> None:
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    dev, (rows, vocab) = logits.device, logits.shape
    check_tensor("output_counts", output_counts, 2, (torch.int32,), dev)
    check_shape("output_counts", output_counts, (rows, vocab))
    check_tensor("prompt_mask", prompt_mask, 2, (torch.bool,), dev)
    check_shape("prompt_mask", prompt_mask, (rows, vocab))
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        check_tensor(name, t, 1, (torch.float32,), dev)
        check_shape(name, t, (rows,))
    check_tensor("bias_ids", bias_ids, 2, (torch.int32,), dev)
    check_tensor("bias_values", bias_values, 2, (torch.float32,), dev)
    if bias_ids.shape[0] != rows:
        raise ValueError(f"bias_ids: {bias_ids.shape[0]} rows for {rows} logits rows")
    check_shape("bias_values", bias_values, bias_ids.shape)
    if bias_ids.stride(0) != bias_values.stride(0):
        raise ValueError("bias_values: must have the same row stride as bias_ids")
    for name, t in (("logits", logits), ("output_counts", output_counts), ("prompt_mask", prompt_mask),
                    ("bias_ids", bias_ids), ("bias_values", bias_values)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")


def apply_penalties(
    logits: torch.Tensor,          # [num_rows, vocab_size] fp32/fp16/bf16, modified in place
    output_counts: torch.Tensor,   # [num_rows, vocab_size] int32: occurrences in the output so far
    prompt_mask: torch.Tensor,     # [num_rows, vocab_size] bool: token occurs in the prompt
    presence: torch.Tensor,        # [num_rows] fp32
    frequency: torch.Tensor,       # [num_rows] fp32
    repetition: torch.Tensor,      # [num_rows] fp32, > 0; 1 disables
    bias_ids: torch.Tensor,        # [num_rows, max_bias] int32, padded with -1 (or value +0.0)
    bias_values: torch.Tensor,     # [num_rows, max_bias] fp32
) -> torch.Tensor:
    _check(logits, output_counts, prompt_mask, presence, frequency, repetition, bias_ids, bias_values)
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits
    block_v = min(_BLOCK_V, next_pow2(vocab))
    num_bias = bias_ids.shape[1]
    _apply_penalties_kernel[(rows, triton.cdiv(vocab, block_v))](
        logits, output_counts, prompt_mask.view(torch.uint8), presence, frequency, repetition,
        bias_ids, bias_values,
        logits.stride(0), output_counts.stride(0), prompt_mask.stride(0), bias_ids.stride(0),
        vocab, num_bias, BLOCK_V=block_v, BIAS_PAD=max(1, next_pow2(num_bias)), num_warps=_NUM_WARPS,
        **FP_FUSION,
    )
    return logits


def apply_penalties_ref(logits, output_counts, prompt_mask, presence, frequency, repetition,
                        bias_ids, bias_values) -> torch.Tensor:
    """Plain-torch ``apply_penalties``: same arguments, same in-place effect."""
    x = logits.float()
    seen = (output_counts > 0) | prompt_mask
    r = repetition[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - frequency[:, None] * output_counts.float() - presence[:, None] * (output_counts > 0).float()
    valid = bias_ids >= 0
    rows = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(bias_ids)
    x.index_put_((rows[valid], bias_ids[valid].long()), bias_values[valid], accumulate=True)
    logits.copy_(x.to(logits.dtype))
    return logits
