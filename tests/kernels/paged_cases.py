"""Random paged-attention batches for the kernel tests, and an independent dense oracle."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedCase:
    query: torch.Tensor            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor         # [num_seqs] int32
    query_lens: tuple[int, ...]
    scale: float


def make_case(seq_lens, query_lens, block_size, num_kv_heads, group, head_dim,
              dtype=torch.float32, device="cpu", seed=0) -> PagedCase:
    """Blocks are handed out in a shuffled order so that no sequence's blocks are contiguous."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3                     # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(q.to(device), kc.to(device), vc.to(device), tables.to(device), qsl.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), tuple(query_lens),
                     head_dim ** -0.5)


def dense_kv(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Rebuild one sequence's K or V token by token: [seq_len, num_kv_heads, head_dim]."""
    bs = cache.shape[1]
    return torch.stack([cache[int(table[t // bs]), t % bs] for t in range(seq_len)])


def dense_attention(case: PagedCase, window: int | None = None) -> torch.Tensor:
    """Plain causal attention (torch SDPA, fp32) per sequence over the densely rebuilt KV; with a
    sliding window, a query at p over positions p - window + 1 .. p only."""
    out = torch.empty(case.query.shape, dtype=torch.float32, device=case.query.device)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens.tolist())):
        k = dense_kv(case.key_cache, case.block_tables[i], seq_len).float().transpose(0, 1)
        v = dense_kv(case.value_cache, case.block_tables[i], seq_len).float().transpose(0, 1)
        q = case.query[start:start + q_len].float().transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def tree_rows(case: PagedCase, trees: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``TreeRows``' index description (node_start [T] int32, visible [T, N] int8) for ``case``
    where sequence ``s`` of ``trees`` ends its query rows with a draft tree of parents
    ``trees[s]`` (``spec_decode.tree``): node i at index n + i, n its known tokens."""
    from sluice.engine.attention.base import NO_TREE
    from sluice.engine.spec_decode.tree import visibility

    num_rows = case.query.shape[0]
    node_start = torch.full((num_rows,), NO_TREE, dtype=torch.int32)
    visible = torch.zeros(num_rows, max(len(p) for p in trees.values()), dtype=torch.int8)
    ends = case.query_start_loc.tolist()[1:]
    for seq, parents in trees.items():
        first, n = ends[seq] - len(parents), int(case.seq_lens[seq]) - len(parents)
        node_start[first:first + len(parents)] = n
        visible[first:first + len(parents), :len(parents)] = torch.tensor(visibility(parents))
    dev = case.query.device
    return node_start.to(dev), visible.to(dev)


def tree_attention(case: PagedCase, trees: dict[int, list[int]]) -> torch.Tensor:
    """What a draft tree's rows must give, computed without a mask: node i's row attends to the
    sequence its path spells, the n known tokens and then its ancestors and itself (their K/V
    taken from the nodes' indices), with nothing hidden. Every other row: ``dense_attention``."""
    from sluice.engine.spec_decode.tree import path

    out = dense_attention(case)
    ends = case.query_start_loc.tolist()[1:]
    for seq, parents in trees.items():
        seq_len = int(case.seq_lens[seq])
        first, n = ends[seq] - len(parents), seq_len - len(parents)
        k_all = dense_kv(case.key_cache, case.block_tables[seq], seq_len).float()
        v_all = dense_kv(case.value_cache, case.block_tables[seq], seq_len).float()
        for i in range(len(parents)):
            keys = list(range(n)) + [n + j for j in path(parents, i)]
            q = case.query[first + i].float()[:, None]                            # [Hq, 1, D]
            k, v = k_all[keys].transpose(0, 1), v_all[keys].transpose(0, 1)       # [Hkv, L, D]
            o = F.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True)
            out[first + i] = o[:, 0]
    return out
