"""The torch attention backend: the CPU default and the reference the Triton kernels are held to.

Per layer: scatter this step's K/V into the paged cache by slot, then attend. Decode rows (one
query token) are batched into a single masked SDPA over their gathered blocks. A short query over
a longer context (speculative verification: K + 1 tokens) gathers its sequence once and attends
with two batched matmuls and a softmax (``_short``). Rows with longer queries (prefill, chunked
prefill, prefix-hit chunks) run one SDPA each, with a causal mask offset by the tokens already in
the cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter by slot; a cache of another dtype (kv_cache_dtype) takes the values rounded to it."""
    key_cache, value_cache = kv_cache
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's cached K or V, densely: [seq_len, num_kv_heads, head_dim], in ``dtype``
    (the queries') when given."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    # index_select with int64 ids: indexing with an int32 tensor takes a far slower path on CPU.
    out = cache.index_select(0, block_table[:num_blocks].long()).flatten(0, 1)[:seq_len]
    return out if dtype is None else out.to(dtype)


# Queries of up to this many tokens over a longer context attend through _short (see forward).
_SHORT_QUERY = 16


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float):
        store_kv(key, value, kv_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            return self._decode(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
        out = torch.empty_like(query)
        decode_rows, decode_seqs, start = [], [], 0
        for i, q_len in enumerate(meta.query_lens_cpu):
            if q_len == 1:
                decode_rows.append(start)
                decode_seqs.append(i)
            start += q_len
        if decode_rows:
            dev = query.device
            rows = torch.tensor(decode_rows, dtype=torch.long, device=dev)
            seqs = torch.tensor(decode_seqs, dtype=torch.long, device=dev)
            out[rows] = self._decode(query[rows], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs],
                                     max(meta.seq_lens_cpu[i] for i in decode_seqs), scale)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len > 1:   # decode rows were done above
                attend = self._short if q_len <= _SHORT_QUERY < seq_len else self._extend
                out[start:start + q_len] = attend(query[start:start + q_len], kv_cache, meta.block_tables[i],
                                                  seq_len, scale)
            start += q_len
        return out

    @staticmethod
    def _short(query, kv_cache: KVCache, block_table, seq_len: int, scale: float):
        """query [Lq, Hq, D] at positions seq_len-Lq .. seq_len-1 of one sequence, Lq small.

        On CPU a masked SDPA for a few query tokens, or one decode row per token (each with its
        own gather of the sequence), cost 3-4x this for 5 tokens over 300 (bench figures in
        the README): the sequence is gathered once, the query heads of each KV head are stacked
        as rows of one matmul, and the causal mask is an additive bias."""
        key_cache, value_cache = kv_cache
        q_len, num_heads, head_dim = query.shape
        num_kv = key_cache.shape[2]
        group = num_heads // num_kv
        k = gather_kv(key_cache, block_table, seq_len, query.dtype)          # [L, Hkv, D]
        v = gather_kv(value_cache, block_table, seq_len, query.dtype)
        # [Hkv, group * Lq, D]: row g * Lq + j is query head (kv * group + g) at token j.
        q = query.view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, group * q_len, head_dim)
        k_pos = torch.arange(seq_len, device=query.device)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        bias = torch.zeros(q_len, seq_len, dtype=torch.float32, device=query.device)
        bias.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        scores = torch.baddbmm(bias.repeat(group, 1).expand(num_kv, -1, -1), q.float(),
                               k.float().permute(1, 2, 0), alpha=scale)     # [Hkv, group * Lq, L]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.bmm(probs, v.transpose(0, 1))                            # [Hkv, group * Lq, D]
        return out.view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)

    @staticmethod
    def _decode(query, kv_cache: KVCache, block_tables, seq_lens, max_seq_len: int, scale: float):
        # query [B, Hq, D]; one new token per sequence, already stored in the cache.
        key_cache, value_cache = kv_cache
        batch, block_size = query.shape[0], key_cache.shape[1]
        num_blocks = -(-max_seq_len // block_size)
        ids = block_tables[:, :num_blocks].reshape(-1).long()
        k = key_cache.index_select(0, ids).view(batch, num_blocks * block_size, *key_cache.shape[2:])    # [B, L, Hkv, D]
        v = value_cache.index_select(0, ids).view(batch, num_blocks * block_size, *key_cache.shape[2:])  # [B, L, Hkv, D]
        k, v = k.to(query.dtype), v.to(query.dtype)   # a no-op unless the cache has its own dtype
        if batch == 1:
            k, v, bias = k[:, :max_seq_len], v[:, :max_seq_len], None
        else:
            # An additive float mask: SDPA on CPU takes a much slower path for boolean masks.
            pos = torch.arange(k.shape[1], device=query.device)
            bias = torch.zeros(batch, 1, 1, k.shape[1], dtype=query.dtype, device=query.device)
            bias.masked_fill_((pos[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),                      # [B, Hq, 1, D]
            k.transpose(1, 2), v.transpose(1, 2),    # [B, Hkv, L, D]
            attn_mask=bias, scale=scale, enable_gqa=True,
        )
        return out.squeeze(2)                        # [B, Hq, D]

    @staticmethod
    def _extend(query, kv_cache: KVCache, block_table, seq_len: int, scale: float):
        # query [Lq, Hq, D]: positions seq_len-Lq .. seq_len-1 of one sequence.
        key_cache, value_cache = kv_cache
        q_len = query.shape[0]
        k = gather_kv(key_cache, block_table, seq_len, query.dtype).transpose(0, 1)    # [Hkv, L, D]
        v = gather_kv(value_cache, block_table, seq_len, query.dtype).transpose(0, 1)  # [Hkv, L, D]
        q = query.transpose(0, 1)                                          # [Hq, Lq, D]
        if q_len == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            bias = torch.zeros(q_len, seq_len, dtype=query.dtype, device=query.device)
            bias.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))   # [Lq, L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)                                         # [Lq, Hq, D]
