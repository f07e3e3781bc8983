"""The torch attention backend: the CPU default and the reference the Triton kernels are held to.

Per layer: scatter this step's K/V into the paged cache by slot, then attend. Decode rows (one
query token) are batched into a single masked SDPA over their gathered blocks. A short query
over a longer context (speculative verification: K + 1 tokens) gathers its sequence once and
attends with two batched matmuls and a softmax (``_short``); several short queries over short
contexts (verification of many short requests, short prompts) attend all at once
(``_short_batch``). Rows with longer queries (prefill, chunked prefill, prefix-hit chunks) run
one SDPA each, with a causal mask offset by the tokens already in the cache. A draft tree's
sequence attends through ``_short`` with the tree's mask (``TreeRows``) in place of the causal one.

Attention soft-capping (``softcap``, Gemma 2: scores -> cap * tanh(score / cap), before the
mask) is not something SDPA does: with a cap every sequence attends through ``_short``'s
matmuls, its queries in chunks of ``_SOFTCAP_CHUNK`` rows (``_softcapped``).

A sliding window (``window``) is one more condition in each of these masks: key position >
query position - window. The gathers start at the block holding the earliest position any of a
sequence's rows sees (``_first_block``): the entries before it may name blocks the KV manager
has freed and another sequence now writes, so they are never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from sluice.kernels._paged_common import tree_seen, window_seen


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter by slot; a cache of another dtype (kv_cache_dtype) takes the values rounded to it."""
    key_cache, value_cache = kv_cache
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              dtype: torch.dtype | None = None, first_block: int = 0) -> torch.Tensor:
    """One sequence's cached K or V, densely from block ``first_block`` on: [seq_len - first_block
    * block_size, num_kv_heads, head_dim], in ``dtype`` (the queries') when given."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    # index_select with int64 ids: indexing with an int32 tensor takes a far slower path on CPU.
    out = cache.index_select(0, block_table[first_block:num_blocks].long()).flatten(0, 1)
    out = out[:seq_len - first_block * block_size]
    return out if dtype is None else out.to(dtype)


def _window_block_ids(tables: torch.Tensor, first: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[B * num_blocks] int64: blocks first[b] .. first[b] + num_blocks - 1 of each table (past a
    table's width: its last entry, which the masks then hide)."""
    cols = first.long()[:, None] + torch.arange(num_blocks, device=tables.device)[None, :]
    cols = cols.clamp(max=tables.shape[1] - 1)
    return tables.gather(1, cols).reshape(-1).long()


def _first_block(seq_len: int, q_len: int, window: int | None, block_size: int) -> int:
    """The first block that rows at positions >= seq_len - q_len read through a window (a draft
    tree's nodes sit at or after their sequence's first query row's position)."""
    return 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size


def _in_window(k_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys a query sees (broadcast): causal, and within the window when there is one."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


# Queries of 2 to this many tokens attend through _short (one sequence over a longer context) or,
# when every such sequence is at most _BATCHED_SHORT_MAX_LEN long, all together through
# _short_batch. One thread, 5-token queries (ms per layer, per-sequence -> batched): 16 sequences
# of 105 tokens 3.8 -> 1.4, 64 of 14 12.7 -> 1.5; at 305 tokens the two are level for 16
# sequences (the gathered context's transpose and padding outweigh the saved calls) and one
# sequence takes 0.35 ms alone against 0.6 batched.
_SHORT_QUERY = 16
_BATCHED_SHORT_MAX_LEN = 256
# Query rows per soft-capped matmul: its scores are at most [Hq, 256, context] float32.
_SOFTCAP_CHUNK = 256


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_trees = True
    supports_softcap = True

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        store_kv(key, value, kv_cache, meta.slot_mapping)
        if softcap is not None:
            return self._softcapped(query, kv_cache, meta, scale, window, softcap)
        if meta.is_pure_decode:
            return self._decode(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale, window)
        out = torch.empty_like(query)
        trees = set() if meta.tree is None else set(meta.tree.tree_seqs)
        decode, short, start = ([], []), ([], []), 0   # (first query row, sequence) of each
        for i, q_len in enumerate(meta.query_lens_cpu):
            if i in trees:     # a draft tree's sequence: _short with the tree's mask
                rows = slice(start, start + q_len)
                seen = tree_seen(meta.tree.node_start[rows], meta.tree.visible[rows], meta.seq_lens_cpu[i])
                if window is not None:
                    # by position (TreeRows.lens: position + 1); the nodes are the row's ancestors
                    seen = window_seen(seen, meta.tree.lens[rows] - 1, window, meta.tree.node_start[rows])
                out[rows] = self._short(query[rows], kv_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale, seen,
                                        window)
            elif q_len <= _SHORT_QUERY:
                group = decode if q_len == 1 else short
                group[0].append(start)
                group[1].append(i)
            start += q_len
        dev = query.device
        if decode[0]:
            rows = torch.tensor(decode[0], dtype=torch.long, device=dev)
            seqs = torch.tensor(decode[1], dtype=torch.long, device=dev)
            out[rows] = self._decode(query[rows], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs],
                                     max(meta.seq_lens_cpu[i] for i in decode[1]), scale, window)
        batched = len(short[1]) > 1 and max(meta.seq_lens_cpu[i] for i in short[1]) <= _BATCHED_SHORT_MAX_LEN
        if batched:
            self._short_batch(query, out, kv_cache, meta, short[0], short[1], scale, window)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len > 1 and i not in trees and not (batched and q_len <= _SHORT_QUERY):   # the others: above
                attend = self._short if q_len <= _SHORT_QUERY < seq_len else self._extend
                out[start:start + q_len] = attend(query[start:start + q_len], kv_cache, meta.block_tables[i],
                                                  seq_len, scale, window=window)
            start += q_len
        return out

    def _softcapped(self, query, kv_cache: KVCache, meta: AttentionMetadata, scale: float, window: int | None,
                    softcap: float):
        """Every sequence through ``_short`` with the cap: a draft tree's with its mask, the
        others' queries ``_SOFTCAP_CHUNK`` rows at a time (a chunk ending at position p - 1 is
        the last rows of the sequence's first p tokens, which is what ``_short`` attends)."""
        out = torch.empty_like(query)
        trees = set() if meta.tree is None else set(meta.tree.tree_seqs)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if i in trees:
                rows = slice(start, start + q_len)
                seen = tree_seen(meta.tree.node_start[rows], meta.tree.visible[rows], seq_len)
                if window is not None:
                    seen = window_seen(seen, meta.tree.lens[rows] - 1, window, meta.tree.node_start[rows])
                out[rows] = self._short(query[rows], kv_cache, meta.block_tables[i], seq_len, scale, seen, window,
                                        softcap)
            else:
                for a in range(0, q_len, _SOFTCAP_CHUNK):
                    b = min(q_len, a + _SOFTCAP_CHUNK)
                    out[start + a:start + b] = self._short(query[start + a:start + b], kv_cache, meta.block_tables[i],
                                                           seq_len - q_len + b, scale, window=window, softcap=softcap)
            start += q_len
        return out

    @staticmethod
    def _short(query, kv_cache: KVCache, block_table, seq_len: int, scale: float, seen: torch.Tensor | None = None,
               window: int | None = None, softcap: float | None = None):
        """query [Lq, Hq, D] at positions seq_len-Lq .. seq_len-1 of one sequence, Lq small.

        On CPU a masked SDPA for a few query tokens, or one decode row per token (each with its
        own gather of the sequence), cost 3-4x this for 5 tokens over 300 (bench/README.md,
        History): the sequence is gathered once, the query heads of each KV head are stacked
        as rows of one matmul, and the causal mask is an additive bias. ``seen`` [Lq, seq_len]
        bool replaces the causal mask (a draft tree's sequence: ``tree_seen``; with a window
        applied, ``window`` says where the gather may start). ``softcap``: the scores are capped
        before the mask is added."""
        key_cache, value_cache = kv_cache
        q_len, num_heads, head_dim = query.shape
        num_kv = key_cache.shape[2]
        group = num_heads // num_kv
        first = _first_block(seq_len, q_len, window, key_cache.shape[1])
        off = first * key_cache.shape[1]                                     # the gather's first position
        k = gather_kv(key_cache, block_table, seq_len, query.dtype, first)   # [L - off, Hkv, D]
        v = gather_kv(value_cache, block_table, seq_len, query.dtype, first)
        # [Hkv, group * Lq, D]: row g * Lq + j is query head (kv * group + g) at token j.
        q = query.view(q_len, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv, group * q_len, head_dim)
        if seen is None:
            k_pos = torch.arange(off, seq_len, device=query.device)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            seen = _in_window(k_pos[None, :], q_pos[:, None], window)
        else:
            seen = seen[:, off:]
        bias = torch.zeros(q_len, seq_len - off, dtype=torch.float32,
                           device=query.device).masked_fill_(~seen, float("-inf"))
        if softcap is None:
            scores = torch.baddbmm(bias.repeat(group, 1).expand(num_kv, -1, -1), q.float(),
                                   k.float().permute(1, 2, 0), alpha=scale)     # [Hkv, group * Lq, L]
        else:
            scores = torch.bmm(q.float(), k.float().permute(1, 2, 0)).mul_(scale / softcap).tanh_().mul_(softcap)
            scores += bias.repeat(group, 1)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.bmm(probs, v.transpose(0, 1))                            # [Hkv, group * Lq, D]
        return out.view(num_kv, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)

    @staticmethod
    def _short_batch(query, out, kv_cache: KVCache, meta: AttentionMetadata, starts: list[int], seqs: list[int],
                     scale: float, window: int | None = None) -> None:
        """Writes ``out``'s rows of the sequences ``seqs``, whose queries (rows ``starts[b]`` on, 2
        to _SHORT_QUERY tokens each) are the last positions of their sequences: speculative
        verification, short prefills and chunks. All of them attend at once: ``_short``'s
        arithmetic, batched. Each sequence's blocks are gathered once, padded to the longest;
        the query heads of each KV head are stacked as rows of one matmul per sequence, padded
        to the longest query (a padding row repeats the sequence's last query and is dropped);
        the causal mask and the padding of shorter sequences are an additive bias."""
        key_cache = kv_cache[0]
        num_heads, head_dim = query.shape[1:]
        block_size, num_kv = key_cache.shape[1], key_cache.shape[2]
        group, dev = num_heads // num_kv, query.device
        q_lens = [meta.query_lens_cpu[i] for i in seqs]
        seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
        batch, q_max, length = len(seqs), max(q_lens), max(seq_lens)
        tables = meta.block_tables[torch.tensor(seqs, device=dev)]
        if window is None:
            num_blocks = -(-length // block_size)
            ids = tables[:, :num_blocks].reshape(-1).long()
            k_pos = torch.arange(length)[None, :]                                                        # [1, L]
        else:   # each sequence from its first block in the window (_first_block); L: the widest span
            first = torch.tensor([_first_block(n, q, window, block_size) for n, q in zip(seq_lens, q_lens)])
            num_blocks = max(-(-n // block_size) - f for n, f in zip(seq_lens, first.tolist()))
            ids = _window_block_ids(tables, first.to(dev), num_blocks)
            length = num_blocks * block_size
            k_pos = first[:, None] * block_size + torch.arange(length)[None, :]                        # [B, L]
        # [B, Hkv, L, D] in the queries' dtype (as _short's gather), made contiguous here so that the
        # matmuls fold (B, Hkv) into one batch without copying again.
        k, v = (cache.index_select(0, ids).view(batch, num_blocks * block_size, num_kv, head_dim)[:, :length]
                .transpose(1, 2).to(query.dtype).contiguous() for cache in kv_cache)
        # Row j of sequence b: query row starts[b] + min(j, q_len - 1), at position seq_len - q_len + j.
        j = torch.arange(q_max)
        ql = torch.tensor(q_lens)
        rows = (torch.tensor(starts)[:, None] + torch.minimum(j[None, :], ql[:, None] - 1)).to(dev)   # [B, Qm]
        q_pos = (torch.tensor(seq_lens) - ql)[:, None] + j[None, :]                                     # [B, Qm]
        # [B, Hkv, group * Qm, D]: row g * Qm + j is query head (kv * group + g) at token j.
        q = query[rows.reshape(-1)].view(batch, q_max, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, num_kv, group * q_max, head_dim).float()
        masked = (~_in_window(k_pos[:, None, :], q_pos[:, :, None], window)).to(dev)                    # [B, Qm, L]
        bias = torch.zeros(batch, q_max, length, dtype=torch.float32, device=dev).masked_fill_(masked, float("-inf"))
        scores = torch.matmul(q, k.float().transpose(2, 3)).mul_(scale)                               # [B, Hkv, G*Qm, L]
        scores += bias.repeat(1, group, 1)[:, None]
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        res = torch.matmul(probs, v)                                                                    # [B, Hkv, G*Qm, D]
        res = res.view(batch, num_kv, group, q_max, head_dim).permute(0, 3, 1, 2, 4).reshape(batch, q_max, num_heads, head_dim)
        keep = (j[None, :] < ql[:, None]).reshape(-1).to(dev)
        out[rows.reshape(-1)[keep]] = res.reshape(batch * q_max, num_heads, head_dim)[keep].to(out.dtype)

    @staticmethod
    def _decode(query, kv_cache: KVCache, block_tables, seq_lens, max_seq_len: int, scale: float,
                window: int | None = None):
        # query [B, Hq, D]; one new token per sequence, already stored in the cache.
        key_cache, value_cache = kv_cache
        batch, block_size = query.shape[0], key_cache.shape[1]
        num_blocks = -(-max_seq_len // block_size)
        pos = torch.arange(num_blocks * block_size, device=query.device)[None, :]   # [1 or B, L] key positions
        if window is not None and max_seq_len > window:
            # Each sequence from the block holding its window's first token: at most this many blocks.
            num_blocks = min(num_blocks, (window + 2 * block_size - 2) // block_size)
            first = (seq_lens.long() - window).clamp(min=0) // block_size                 # [B]
            ids = _window_block_ids(block_tables, first, num_blocks)
            pos = first[:, None] * block_size + torch.arange(num_blocks * block_size, device=query.device)[None, :]
        else:
            ids = block_tables[:, :num_blocks].reshape(-1).long()
        k = key_cache.index_select(0, ids).view(batch, num_blocks * block_size, *key_cache.shape[2:])    # [B, L, Hkv, D]
        v = value_cache.index_select(0, ids).view(batch, num_blocks * block_size, *key_cache.shape[2:])  # [B, L, Hkv, D]
        k, v = k.to(query.dtype), v.to(query.dtype)   # a no-op unless the cache has its own dtype
        if batch == 1 and (window is None or max_seq_len <= window):
            k, v, bias = k[:, :max_seq_len], v[:, :max_seq_len], None
        else:
            # An additive float mask: SDPA on CPU takes a much slower path for boolean masks.
            keep = _in_window(pos, seq_lens[:, None].long() - 1, window)
            bias = torch.zeros(batch, 1, 1, k.shape[1], dtype=query.dtype, device=query.device)
            bias.masked_fill_(~keep[:, None, None, :], float("-inf"))
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),                      # [B, Hq, 1, D]
            k.transpose(1, 2), v.transpose(1, 2),    # [B, Hkv, L, D]
            attn_mask=bias, scale=scale, enable_gqa=True,
        )
        return out.squeeze(2)                        # [B, Hq, D]

    @staticmethod
    def _extend(query, kv_cache: KVCache, block_table, seq_len: int, scale: float, window: int | None = None):
        # query [Lq, Hq, D]: positions seq_len-Lq .. seq_len-1 of one sequence.
        key_cache, value_cache = kv_cache
        q_len = query.shape[0]
        first = _first_block(seq_len, q_len, window, key_cache.shape[1])
        off = first * key_cache.shape[1]
        k = gather_kv(key_cache, block_table, seq_len, query.dtype, first).transpose(0, 1)    # [Hkv, L - off, D]
        v = gather_kv(value_cache, block_table, seq_len, query.dtype, first).transpose(0, 1)  # [Hkv, L - off, D]
        q = query.transpose(0, 1)                                          # [Hq, Lq, D]
        if q_len == seq_len and (window is None or seq_len <= window):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(off, seq_len, device=query.device)
            bias = torch.zeros(q_len, seq_len - off, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~_in_window(k_pos[None, :], q_pos[:, None], window), float("-inf"))   # [Lq, L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)                                         # [Lq, Hq, D]
