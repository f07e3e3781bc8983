"""Shared by the paged attention kernels: argument checks and the dense gather of the references."""
from __future__ import annotations

import math

import torch

from sluice.kernels._checks import FLOAT_DTYPES, check_last_dim_contiguous, check_same_dtype, check_shape, check_tensor

LOG2E = math.log2(math.e)
NO_WINDOW = 1 << 30      # the kernels' window argument when attention spans the whole prefix


def check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < NO_WINDOW):
        raise ValueError(f"window: must be None or a positive integer below {NO_WINDOW}, got {window!r}")


def check_paged_inputs(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,   # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,       # [num_seqs]
) -> None:
    check_tensor("key_cache", key_cache, 4, FLOAT_DTYPES)
    dev = key_cache.device
    check_tensor("value_cache", value_cache, 4, FLOAT_DTYPES, dev)
    check_shape("value_cache", value_cache, key_cache.shape)
    check_tensor("query", query, 3, FLOAT_DTYPES, dev)
    check_same_dtype("query", query, "key_cache", key_cache)
    check_same_dtype("value_cache", value_cache, "key_cache", key_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query: head_dim {query.shape[2]} differs from the cache's head_dim {head_dim}")
    if query.shape[1] % num_kv_heads != 0:
        raise ValueError(f"query: num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), dev)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {seq_lens.shape[0]} sequences")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables)):
        check_last_dim_contiguous(name, t)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches are the CPU/test path: keep full precision rather than tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


def gather_dense(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's K or V rebuilt densely from its block table: [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def tree_seen(node_start: torch.Tensor, visible: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[Q, seq_len] bool: which indices of its sequence each of Q query rows, the sequence's last
    (indices seq_len - Q .. seq_len - 1), attends to with draft trees: causally, except that from
    its ``node_start`` [Q] on only the nodes ``visible`` [Q, N] marks (the rule of
    ``paged_prefill``'s module doc)."""
    first = node_start.long()[:, None]                                          # [Q, 1]
    cols = torch.arange(seq_len, device=first.device)[None, :]                   # [1, L]
    rows = torch.arange(seq_len - first.shape[0], seq_len, device=first.device)[:, None]
    marked = visible.gather(1, (cols - first).clamp(0, visible.shape[1] - 1)) != 0
    return (cols <= rows) & ((cols < first) | marked)


def tree_positions(node_start: torch.Tensor, visible: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[Q] int64: the positions of a sequence's last Q query rows with draft trees. A known
    token's row sits at its index; a node at node_start - 1 + its depth, and its depth is the
    number of nodes it sees (its ancestors and itself)."""
    q = node_start.shape[0]
    index = torch.arange(seq_len - q, seq_len, device=node_start.device)
    first = node_start.long()
    depth = (visible != 0).sum(1)
    return torch.where(index >= first, first - 1 + depth, index)


def window_seen(seen: torch.Tensor, q_positions: torch.Tensor, window: int,
                node_start: torch.Tensor | None = None) -> torch.Tensor:
    """``seen`` [Q, L] less the keys before each row's window (key index c at position c), except
    a draft tree's nodes (c >= node_start), which are the row's ancestors, within any window
    longer than the tree is deep."""
    cols = torch.arange(seen.shape[1], device=seen.device)[None, :]
    out = cols <= q_positions.long()[:, None] - window
    if node_start is not None:
        out &= cols < node_start.long()[:, None]
    return seen & ~out


def attention_ref(
    query: torch.Tensor,   # [q_len, num_heads, head_dim]: positions seq_len-q_len .. seq_len-1
    key: torch.Tensor,     # [seq_len, num_kv_heads, head_dim]
    value: torch.Tensor,   # [seq_len, num_kv_heads, head_dim]
    scale: float,
    seen: torch.Tensor | None = None,   # [q_len, seq_len] bool in place of the causal mask (tree_seen)
    window: int | None = None,          # sliding window (without seen): a query at p sees p - window + 1 .. p
) -> torch.Tensor:         # [q_len, num_heads, head_dim], in fp32
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)    # [num_heads, seq_len, head_dim]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    q = query.float().transpose(0, 1)                                   # [num_heads, q_len, head_dim]
    scores = q @ k.transpose(1, 2) * scale                              # [num_heads, q_len, seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None] if seen is None else ~seen
    if window is not None:
        if seen is not None:
            raise ValueError("window: pass seen with the window applied (window_seen) instead")
        hidden = hidden | (k_pos[None, :] <= q_pos[:, None] - window)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)
