"""Rejection sampling for speculative decoding (Leviathan et al. / Chen et al.).

Per row, draft tokens ``d_0..d_{K-1}`` were drawn from the draft distributions ``q_k``; the
target model gave ``p_0..p_K``. Token ``d_k`` is accepted with probability
``min(1, p_k[d_k] / q_k[d_k])``, in order, until the first rejection at ``k``, where a token is
drawn from ``norm(max(0, p_k - q_k))`` instead. If all K are accepted a bonus token is drawn
from ``p_K``. Each emitted token is then distributed exactly as the target would have sampled.

Output row: the accepted drafts, then the resampled or bonus token, then ``-1`` padding;
``num_emitted = accepted + 1``. Randomness: Philox keyed by the row's ``seed``, counter
``(offset << 32) + k`` for the k-th acceptance test and ``+ K + 1`` for the final draw.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FP_FUSION, check_shape, check_tensor

# Tuning: one program per row; the final draw streams the vocabulary in 2048-wide tiles.
_BLOCK_V = 2048
_NUM_WARPS = 4


@triton.jit
def _rejection_sample_kernel(
    draft_ids_ptr, draft_probs_ptr, target_probs_ptr, seeds_ptr, offsets_ptr, out_ptr, num_emitted_ptr,
    stride_draft_ids_row, stride_draft_probs_row, stride_draft_probs_pos,
    stride_target_probs_row, stride_target_probs_pos, stride_out_row,
    num_draft, vocab_size,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    counter = tl.load(offsets_ptr + row).to(tl.int64) << 32
    q_row = draft_probs_ptr + row * stride_draft_probs_row
    p_row = target_probs_ptr + row * stride_target_probs_row
    out_row = out_ptr + row * stride_out_row

    accepted = tl.full([], 0, tl.int32)
    rejected = tl.full([], 0, tl.int1)
    for k in range(0, num_draft):
        tok = tl.load(draft_ids_ptr + row * stride_draft_ids_row + k).to(tl.int64)
        q = tl.load(q_row + k * stride_draft_probs_pos + tok).to(tl.float32)
        p = tl.load(p_row + k * stride_target_probs_pos + tok).to(tl.float32)
        u = tl.rand(seed, counter + k)
        ok = (u * q < p) & ~rejected           # u < p / q without dividing by q
        tl.store(out_row + k, tl.where(ok, tok, -1))
        accepted += ok.to(tl.int32)
        rejected = rejected | ~ok
    tl.store(out_row + num_draft, -1)

    # Final draw at position `accepted`: residual max(0, p - q) after a rejection, p_K if none.
    pos = accepted.to(tl.int64)
    use_q = (accepted < num_draft).to(tl.float32)
    p_pos = p_row + pos * stride_target_probs_pos
    q_pos = q_row + tl.minimum(pos, num_draft - 1) * stride_draft_probs_pos
    u = tl.rand(seed, counter + num_draft + 1)
    token = _draw_residual(p_pos, q_pos, use_q, u, vocab_size, BLOCK_V)
    tl.store(out_row + pos, token)
    tl.store(num_emitted_ptr + row, accepted + 1)


@triton.jit
def _draw_residual(p_ptr, q_ptr, use_q, u, vocab_size, BLOCK_V: tl.constexpr):
    cols0 = tl.arange(0, BLOCK_V)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        r = _residual(p_ptr, q_ptr, use_q, cols, vocab_size)
        total += tl.sum(r, 0)
    # p == q everywhere leaves no residual (and cannot reject); fall back to p for safety.
    use_q = tl.where(total > 0, use_q, 0.0)
    total = tl.where(total > 0, total, 1.0)
    target = u * total
    running = tl.full([], 0.0, tl.float32)
    chosen = tl.full([], 0, tl.int64) + vocab_size
    last = tl.full([], -1, tl.int64)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        r = _residual(p_ptr, q_ptr, use_q, cols, vocab_size)
        c = tl.cumsum(r, 0) + running
        hit = tl.min(tl.where((c > target) & (r > 0), cols, vocab_size), 0).to(tl.int64)
        chosen = tl.where(chosen == vocab_size, hit, chosen)
        last = tl.maximum(last, tl.max(tl.where(r > 0, cols, -1), 0).to(tl.int64))
        running += tl.sum(r, 0)
    chosen = tl.where(chosen == vocab_size, last, chosen)
    return tl.where(chosen < 0, 0, chosen)


@triton.jit
def _residual(p_ptr, q_ptr, use_q, cols, vocab_size):
    in_vocab = cols < vocab_size
    p = tl.load(p_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
    return tl.maximum(p - q * use_q, 0.0)


def _check(draft_ids, draft_probs, target_probs, seeds, offsets) -> None:
    check_tensor("draft_token_ids", draft_ids, 2, (torch.int32, torch.int64))
    dev, (rows, k) = draft_ids.device, draft_ids.shape
    if k < 1:
        raise ValueError("draft_token_ids: need at least one draft token per row")
    check_tensor("target_probs", target_probs, 3, (torch.float32, torch.float16, torch.bfloat16), dev)
    vocab = target_probs.shape[2]
    check_shape("target_probs", target_probs, (rows, k + 1, vocab))
    check_tensor("draft_probs", draft_probs, 3, (torch.float32, torch.float16, torch.bfloat16), dev)
    check_shape("draft_probs", draft_probs, (rows, k, vocab))
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        check_tensor(name, t, 1, (torch.int64,), dev)
        check_shape(name, t, (rows,))
    for name, t in (("draft_token_ids", draft_ids), ("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")


def rejection_sample(
    draft_token_ids: torch.Tensor,   # [num_rows, K] int32/int64
    draft_probs: torch.Tensor,       # [num_rows, K, vocab_size]: q_k, the draft distributions
    target_probs: torch.Tensor,      # [num_rows, K + 1, vocab_size]: p_k, the target distributions
    seeds: torch.Tensor,             # [num_rows] int64
    offsets: torch.Tensor,           # [num_rows] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [num_rows, K + 1] int64 (-1 padded), num_emitted [num_rows] int32
    _check(draft_token_ids, draft_probs, target_probs, seeds, offsets)
    rows, k = draft_token_ids.shape
    out = torch.empty(rows, k + 1, dtype=torch.int64, device=draft_token_ids.device)
    num_emitted = torch.empty(rows, dtype=torch.int32, device=draft_token_ids.device)
    if rows == 0:
        return out, num_emitted
    vocab = target_probs.shape[2]
    _rejection_sample_kernel[(rows,)](
        draft_token_ids, draft_probs, target_probs, seeds, offsets, out, num_emitted,
        draft_token_ids.stride(0), draft_probs.stride(0), draft_probs.stride(1),
        target_probs.stride(0), target_probs.stride(1), out.stride(0),
        k, vocab, BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)), num_warps=_NUM_WARPS,
        **FP_FUSION,
    )
    return out, num_emitted


def rejection_sample_ref(draft_token_ids, draft_probs, target_probs, generator: torch.Generator | None = None):
    """Plain-torch ``rejection_sample`` (same outputs, randomness from one torch generator)."""
    rows, k = draft_token_ids.shape
    out = torch.full((rows, k + 1), -1, dtype=torch.int64, device=draft_token_ids.device)
    num_emitted = torch.empty(rows, dtype=torch.int32, device=draft_token_ids.device)
    p_all, q_all = target_probs.float(), draft_probs.float()
    for i in range(rows):
        pos = k
        for j in range(k):
            tok = int(draft_token_ids[i, j])
            u = torch.rand((), generator=generator, device=p_all.device)
            if u * q_all[i, j, tok] < p_all[i, j, tok]:
                out[i, j] = tok
            else:
                pos = j
                break
        dist = p_all[i, pos] if pos == k else (p_all[i, pos] - q_all[i, pos]).clamp_min(0)
        if dist.sum() <= 0:
            dist = p_all[i, pos]
        out[i, pos] = torch.multinomial(dist, 1, generator=generator)[0]
        num_emitted[i] = pos + 1
    return out, num_emitted
