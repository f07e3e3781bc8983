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


def dense_attention(case: PagedCase) -> torch.Tensor:
    """Plain causal attention (torch SDPA, fp32) per sequence over the densely rebuilt KV."""
    out = torch.empty(case.query.shape, dtype=torch.float32, device=case.query.device)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens.tolist())):
        k = dense_kv(case.key_cache, case.block_tables[i], seq_len).float().transpose(0, 1)
        v = dense_kv(case.value_cache, case.block_tables[i], seq_len).float().transpose(0, 1)
        q = case.query[start:start + q_len].float().transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out
