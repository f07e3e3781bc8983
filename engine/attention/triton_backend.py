"""The Triton attention backend: the CUDA default, and runnable on CPU under TRITON_INTERPRET=1.

Per layer: ``kv_store`` writes this step's K/V into the paged cache by slot, then a pure-decode
step (every sequence brings one token) runs the split-KV decode kernel and any other step runs
the varlen prefill/extend kernel, which covers prefill, chunked prefill, prefix hits, mixed
decode rows and speculative verification alike, draft trees included.
"""
from __future__ import annotations

import torch

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from sluice.kernels.kv_store import kv_store
from sluice.kernels.paged_decode import paged_decode
from sluice.kernels.paged_prefill import paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_trees = True

    def forward(
        self,
        query: torch.Tensor,      # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,      # [num_tokens, num_kv_heads, head_dim]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:            # [num_tokens, num_heads, head_dim]
        if softcap is not None:
            raise ValueError("attention_backend=triton: attention soft-capping is not supported by the Triton "
                             "kernels (attention_backend=torch applies it)")
        key_cache, value_cache = kv_cache
        kv_store(key, value, key_cache, value_cache, meta.slot_mapping)
        if meta.is_pure_decode and query.shape[0] == meta.num_seqs:
            return paged_decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                max_seq_len=meta.max_seq_len, window=window)
        return self.extend(query, kv_cache, meta, scale, window)

    @staticmethod
    def extend(query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
               window: int | None = None) -> torch.Tensor:
        """Varlen attention of the batch's queries over the cache (K/V already stored), through
        the draft trees' mask when the step carries trees."""
        key_cache, value_cache = kv_cache
        tree = {} if meta.tree is None else {"node_start": meta.tree.node_start, "visible": meta.tree.visible}
        return paged_prefill(query, key_cache, value_cache, meta.block_tables, meta.query_start_loc,
                             meta.seq_lens, scale, max_query_len=meta.max_query_len, window=window, **tree)
