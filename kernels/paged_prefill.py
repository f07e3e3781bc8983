"""Paged prefill / extend attention over a varlen batch.

Sequence ``i`` brings query rows ``query_start_loc[i]:query_start_loc[i+1]``, at positions
``seq_lens[i]-q_len .. seq_lens[i]-1``; its K/V, new tokens included, are already in the paged
cache. Each query attends causally to every earlier token through the block table, so the one
kernel covers plain prefill (empty prefix), chunked prefill and prefix-cache hits (cached
prefix), and speculative verification (a few rows on a long prefix).

One program per (query tile, sequence, query head). Tokens are gathered through the block
table one by one, which makes any block size work.

Draft trees (speculative decoding, ``spec_decode.tree``): with ``node_start`` [T] int32 and
``visible`` [T, N] int8, a query row at index r of its sequence sees index c when c <= r and
(c < node_start[row] or visible[row, c - node_start[row]]): the step wrote a tree's nodes after
the known tokens, and a node sees only its ancestors and itself among them
(``engine.attention.base.TreeRows``). Without them the kernel is compiled without the test.

A sliding window (``window``) hides the keys at positions <= the row's position - window. A
row's position is its index, except a tree node's: node_start - 1 + its depth (the nodes it
sees, ``_paged_common.tree_positions``); the window applies to the known tokens, a node's
ancestors being within it. A tile's loop starts at its first row's window, so that no earlier
block-table entry is read (the KV manager may have freed those blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FP_FUSION, check_last_dim_contiguous, check_shape, check_tensor, next_pow2
from sluice.kernels._paged_common import (LOG2E, NO_WINDOW, attention_ref, check_paged_inputs, check_window,
                                         dot_precision, gather_dense, tree_positions, tree_seen, window_seen)

# Tuning (H100-class GPUs, head_dim <= 128): 64x64 tiles, 4 warps, 2 pipeline stages.
_BLOCK_M = 64
# With draft trees: verification's rows are few (1 + the nodes, 13 by default) and the mask's
# [BLOCK_M, BLOCK_N] index and gather tensors need registers; 64-row tiles spilled on sm_90.
_TREE_BLOCK_M = 16
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


def block_n_for(dtype: torch.dtype, head_dim_pad: int) -> int:
    """Key tile width. Rows wider than 512 bytes (fp32 at head_dim 256) get 32-token tiles: with 64,
    the kernel needs 213 KB of shared memory, more than an A100 block may have (163 KB)."""
    return _BLOCK_N if dtype.itemsize * head_dim_pad <= 512 else _BLOCK_N // 2


@triton.jit
def _paged_prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    node_start_ptr, visible_ptr,
    stride_query_tok, stride_query_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_seq, stride_out_tok, stride_out_head, stride_vis_tok,
    scale_log2, block_size, head_dim, num_nodes, window,
    GROUP: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NODES_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TREE: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)              # [BLOCK_M] query index in the chunk
    d = tl.arange(0, HEAD_DIM_PAD)
    q_pos = context_len + rows                                     # [BLOCK_M]
    q_mask = (rows < q_len)[:, None] & (d < head_dim)[None, :]
    q_off = (q_start + rows).to(tl.int64)[:, None] * stride_query_tok + head * stride_query_head + d[None, :]
    q = tl.load(query_ptr + q_off, mask=q_mask, other=0.0)        # [BLOCK_M, HEAD_DIM_PAD]
    if TREE:   # each row's first tree node (rows past the chunk: none), and the tile's first
        node_start = tl.load(node_start_ptr + q_start + rows, mask=rows < q_len, other=1 << 30)
        tree_lo = tl.min(node_start, axis=0)
        j = tl.arange(0, NODES_PAD)
        vis = tl.load(visible_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_vis_tok + j[None, :],
                      mask=(rows < q_len)[:, None] & (j < num_nodes)[None, :], other=0)
        depth = tl.sum((vis != 0).to(tl.int32), 1)
        w_pos = tl.where(q_pos >= node_start, node_start - 1 + depth, q_pos)   # [BLOCK_M] positions
    else:
        w_pos = q_pos
    w_lo = tl.min(tl.where(rows < q_len, w_pos, 1 << 30), axis=0) - window + 1

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_bt_seq
    # The last row of this tile sees up to position context_len + (m_block+1)*BLOCK_M - 1.
    hi = tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M)
    for start in range(tl.maximum(w_lo, 0), hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)                        # [BLOCK_N]
        valid = pos < hi
        block = tl.load(table_ptr + pos // block_size, mask=valid, other=0).to(tl.int64)
        slot = (pos % block_size).to(tl.int64)
        kv_mask = valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(key_cache_ptr + block[:, None] * stride_kc_block + slot[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2       # [BLOCK_M, BLOCK_N]
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if TREE:
            seen = seen & ((pos[None, :] > w_pos[:, None] - window) | (pos[None, :] >= node_start[:, None]))
        else:
            seen = seen & (pos[None, :] > w_pos[:, None] - window)
        if TREE:
            # Past a row's node_start, only the nodes it marks visible: a gather, in the key
            # tiles that reach a tree only (the last one or two of a long sequence).
            if start + BLOCK_N > tree_lo:
                rel = pos[None, :] - node_start[:, None]                  # [BLOCK_M, BLOCK_N]
                in_tree = seen & (rel >= 0) & (rel < num_nodes)
                marked = tl.load(visible_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_vis_tok + rel,
                                 mask=in_tree, other=0)
                seen = seen & ((rel < 0) | (marked != 0))
        s = tl.where(seen, s, float("-inf"))
        # A row may see nothing in a tile (a window starts past it, a tree hides it): its
        # maximum stays -inf, and the exponents are taken from 0 then (they are all -inf).
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_off = (q_start + rows).to(tl.int64)[:, None] * stride_out_tok + head * stride_out_head + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,         # [num_seqs] int32, this step's tokens included (already stored)
    scale: float,
    max_query_len: int | None = None,
    node_start: torch.Tensor | None = None,   # [num_tokens] int32: draft trees (module doc)
    visible: torch.Tensor | None = None,      # [num_tokens, num_nodes] int8
    window: int | None = None,                # sliding window (module doc)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    check_window(window)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), query.device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    tree = _check_tree(query, node_start, visible)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    dim_pad = max(16, next_pow2(head_dim))
    block_m = _TREE_BLOCK_M if tree else _BLOCK_M
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    if not tree:   # unused pointers: any tensor of the device
        node_start, visible = seq_lens, seq_lens[:, None]
    _paged_prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, node_start, visible,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), visible.stride(0),
        scale * LOG2E, block_size, head_dim, visible.shape[1], NO_WINDOW if window is None else window,
        GROUP=num_heads // num_kv_heads, HEAD_DIM_PAD=dim_pad, NODES_PAD=max(16, next_pow2(visible.shape[1])),
        BLOCK_M=block_m, BLOCK_N=block_n_for(query.dtype, dim_pad), DOT_PRECISION=dot_precision(query.dtype),
        TREE=tree, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, **FP_FUSION,
    )
    return out


def _check_tree(query: torch.Tensor, node_start: torch.Tensor | None, visible: torch.Tensor | None) -> bool:
    """Whether the call carries draft trees; their two tensors checked."""
    if (node_start is None) != (visible is None):
        raise ValueError("node_start and visible go together (draft trees): got one without the other")
    if node_start is None:
        return False
    num_tokens = query.shape[0]
    check_tensor("node_start", node_start, 1, (torch.int32,), query.device)
    check_shape("node_start", node_start, (num_tokens,))
    check_tensor("visible", visible, 2, (torch.int8,), query.device)
    if visible.shape[0] != num_tokens or visible.shape[1] < 1:
        raise ValueError(f"visible: expected [{num_tokens}, num_nodes >= 1], got {list(visible.shape)}")
    check_last_dim_contiguous("visible", visible)
    return True


def paged_prefill_ref(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale: float,
                      node_start=None, visible=None, window: int | None = None):
    """Plain-torch ``paged_prefill``: per sequence, gather its KV densely and attend causally (or
    through the draft trees' mask)."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        k = gather_dense(key_cache, block_tables[i], seq_len)
        v = gather_dense(value_cache, block_tables[i], seq_len)
        if node_start is None:
            out[lo:hi] = attention_ref(query[lo:hi], k, v, scale, window=window).to(query.dtype)
            continue
        seen = tree_seen(node_start[lo:hi], visible[lo:hi], seq_len)
        if window is not None:
            at = tree_positions(node_start[lo:hi], visible[lo:hi], seq_len)
            seen = window_seen(seen, at, window, node_start[lo:hi])
        out[lo:hi] = attention_ref(query[lo:hi], k, v, scale, seen).to(query.dtype)
    return out
