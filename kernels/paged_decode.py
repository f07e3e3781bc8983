"""Paged decode attention: one query token per sequence against that sequence's cached blocks.

One program per (sequence, KV head, split). The program loads all query heads of its KV head's
group as the rows of one tile, so each K/V tile is read once per group (GQA without repeating
KV). Tokens are gathered one by one through the block table, which makes any block size work,
1 included. Long contexts are cut into ``num_splits`` token ranges run in parallel; each writes
a partial output and its log-sum-exp, and a second kernel combines them.

A sliding window (``window``) limits sequence i to its last ``window`` tokens (positions
seq_len - window .. seq_len - 1): the splits cut that range, and no earlier block-table entry
is read (the KV manager may have freed those blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FP_FUSION, next_pow2
from sluice.kernels._paged_common import (LOG2E, NO_WINDOW, attention_ref, check_paged_inputs, check_window,
                                         dot_precision, gather_dense)

# Tuning (H100-class GPUs): 64-token tiles; split only when fewer than ~2 waves of programs
# would run, and never give a split fewer than 256 tokens; splits are powers of two so that
# few kernel variants get compiled.
_BLOCK_N = 64
_MIN_GROUP_ROWS = 16          # tl.dot needs at least 16 rows
_TARGET_PROGRAMS = 256
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64
_NUM_WARPS = 4


@triton.jit
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    stride_query_seq, stride_query_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_seq, stride_out_seq, stride_out_head,
    scale_log2, block_size, head_dim, tokens_per_split, num_heads, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = tl.maximum(seq_len - window, 0)                       # the window's first token
    lo = first + split * tokens_per_split
    hi = tl.minimum(seq_len, lo + tokens_per_split)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g                                   # [GROUP_PAD]
    q_mask = (g < GROUP)[:, None] & (d < head_dim)[None, :]
    q = tl.load(query_ptr + seq * stride_query_seq + heads[:, None] * stride_query_head + d[None, :],
                mask=q_mask, other=0.0)                           # [GROUP_PAD, HEAD_DIM_PAD]

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)                       # [BLOCK_N]
        valid = pos < hi
        block = tl.load(table_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        kv_mask = valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(key_cache_ptr + block[:, None] * stride_kc_block + slot[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2       # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]   # an empty split (or sequence) yields zeros
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * num_heads + heads) * NUM_SPLITS + split     # [GROUP_PAD]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], o, mask=q_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))  # log2 domain
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_out_seq, stride_out_head, num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    row = (seq * num_heads + head) * NUM_SPLITS + s                # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)                                           # [SPLITS_PAD]; 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :],
                mask=(s < NUM_SPLITS)[:, None] & (d < head_dim)[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)  # [HEAD_DIM_PAD]
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             res.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    programs = max(1, num_seqs * num_kv_heads)
    want = max(1, _TARGET_PROGRAMS // programs)
    cap = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    splits = min(want, cap, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def paged_decode(
    query: torch.Tensor,          # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,   # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,       # [num_seqs] int32, the new token included (already stored)
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,    # sliding window: each sequence's last ``window`` tokens only
) -> torch.Tensor:                # [num_seqs, num_heads, head_dim]
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    check_window(window)
    num_seqs, num_heads, head_dim = query.shape
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} sequences for {num_seqs} decode query rows")
    _, block_size, num_kv_heads, _ = key_cache.shape
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if num_seqs else 0
    span = max_seq_len if window is None else min(max_seq_len, window)   # tokens a sequence reads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, span)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    dim_pad = max(16, next_pow2(head_dim))
    tokens_per_split = triton.cdiv(max(span, 1), num_splits)
    part_out = part_lse = out  # unused when there is a single split
    if num_splits > 1:
        part_out = torch.empty(num_seqs * num_heads * num_splits, dim_pad, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs * num_heads * num_splits, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, block_size, head_dim, tokens_per_split, num_heads, NO_WINDOW if window is None else window,
        GROUP=group, GROUP_PAD=max(_MIN_GROUP_ROWS, next_pow2(group)), HEAD_DIM_PAD=dim_pad,
        BLOCK_N=_BLOCK_N, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(query.dtype), num_warps=_NUM_WARPS,
        **FP_FUSION,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, head_dim,
            NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits), HEAD_DIM_PAD=dim_pad, **FP_FUSION,
        )
    return out


def paged_decode_ref(query, key_cache, value_cache, block_tables, seq_lens, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Plain-torch ``paged_decode``: gather each sequence's KV densely, attend, return query's dtype."""
    out = torch.zeros_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_dense(key_cache, block_tables[i], seq_len)
        v = gather_dense(value_cache, block_tables[i], seq_len)
        out[i] = attention_ref(query[i:i + 1], k, v, scale, window=window)[0].to(query.dtype)
    return out
