"""The torch attention backend over a paged cache equals plain causal attention on dense K/V.

Each case scatters random sequences into shuffled blocks, runs one varlen step (prefill, chunk
after cached context, decode, and short queries, which take their own paths: one sequence at a
time over a longer context, or all together when every context is short; speculative
verification) and compares every sequence with its dense reference; a step with draft trees
attends through the trees' mask.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.attention.base import AttentionMetadata, TreeRows
from sluice.engine.attention.torch_backend import TorchAttentionBackend
from tests.kernels.paged_cases import dense_attention, make_case, tree_attention, tree_rows


def _dense_ref(q, k, v, ctx, scale):
    # q [Lq, Hq, D]; k, v [L, Hkv, D]; query j sits at position ctx + j.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("lens", [[(0, 5), (3, 4), (9, 1), (15, 1)], [(16, 1), (7, 1)], [(0, 16), (0, 1)],
                                  [(20, 5), (30, 1), (0, 6), (25, 17)], [(40, 5)], [(12, 16), (3, 2)],
                                  [(300, 5), (0, 3), (2, 1)]])
def test_paged_matches_dense(block_size, q_heads, kv_heads, lens):
    torch.manual_seed(0)
    head_dim, num_blocks = 8, 512
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    perm = torch.randperm(num_blocks).tolist()
    dense_k, dense_v, tables, slots, queries = [], [], [], [], []
    for ctx, q_len in lens:
        seq_len = ctx + q_len
        nb = -(-seq_len // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        k = torch.randn(seq_len, kv_heads, head_dim)
        v = torch.randn(seq_len, kv_heads, head_dim)
        for p in range(ctx):  # the cached prefix is already in the pool
            key_cache[table[p // block_size], p % block_size] = k[p]
            value_cache[table[p // block_size], p % block_size] = v[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len)]
        dense_k.append(k)
        dense_v.append(v)
        queries.append(torch.randn(q_len, q_heads, head_dim))
    width = max(len(t) for t in tables)
    q_lens = [q for _, q in lens]
    seq_lens = [c + q for c, q in lens]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in lens], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(q_lens), seq_lens_cpu=tuple(seq_lens),
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(dense_k, lens)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(dense_v, lens)])
    scale = head_dim ** -0.5
    out = TorchAttentionBackend().forward(torch.cat(queries), new_k, new_v, (key_cache, value_cache), meta, scale)
    start = 0
    for q, k, v, (ctx, q_len) in zip(queries, dense_k, dense_v, lens):
        torch.testing.assert_close(out[start:start + q_len], _dense_ref(q, k, v, ctx, scale), rtol=1e-5, atol=1e-5)
        start += q_len


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("q_heads,kv_heads", [(6, 2), (4, 4)])
def test_draft_tree_rows_see_the_known_tokens_and_their_own_path(block_size, q_heads, kv_heads):
    """A step with draft trees (``TreeRows``' index description) beside a decode row, a short
    query and a chunk: each node's row is attention over the sequence its path spells
    (``tree_attention``, which needs no mask), every other row stays causal."""
    trees = {0: [-1, -1, 0, 0, 2, 1], 3: [-1, 0, 1, -1, 3, 2, 0]}
    seq_lens, query_lens = [30 + 6, 20, 9, 5 + 7, 40], [1 + 6, 1, 3, 3 + 7, 20]
    case = make_case(seq_lens, query_lens, block_size, kv_heads, q_heads // kv_heads, 8, seed=3)
    node_start, visible = tree_rows(case, trees)
    none = torch.empty(0)    # the C++ layer stack's description of the rows: not read here
    meta = AttentionMetadata(
        slot_mapping=_slots(case), query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        context_lens=case.seq_lens - torch.tensor(query_lens, dtype=torch.int32), block_tables=case.block_tables,
        block_size=block_size, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens),
        tree=TreeRows(none, none, none, node_start, visible, tuple(trees)))
    flat_k, flat_v = (c.flatten(0, 1) for c in (case.key_cache, case.value_cache))
    # This step's K/V: what the cache already holds at its slots (storing them changes nothing).
    new_k, new_v = flat_k[meta.slot_mapping].clone(), flat_v[meta.slot_mapping].clone()
    backend = TorchAttentionBackend()
    out = backend.forward(case.query, new_k, new_v, (case.key_cache, case.value_cache), meta, case.scale)
    torch.testing.assert_close(out, tree_attention(case, trees), rtol=1e-5, atol=1e-5)
    plain = backend.forward(case.query, new_k, new_v, (case.key_cache, case.value_cache), replace(meta, tree=None),
                            case.scale)
    torch.testing.assert_close(plain, dense_attention(case), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[3:7], out[3:7], atol=1e-3)


def _slots(case) -> torch.Tensor:
    """The flat cache slots of every query row of ``case`` (its sequences' last positions)."""
    bs = case.key_cache.shape[1]
    out = []
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens.tolist())):
        out += [int(case.block_tables[i, p // bs]) * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    return torch.tensor(out)
