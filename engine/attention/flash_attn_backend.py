"""The flash-attn backend: flash-attn's varlen kernel for fresh prefills on CUDA, Triton otherwise.

flash-attn (the optional ``gpu`` extra) is imported when the backend is built, never at module
import. Its paged path wants pages of 256 tokens, far from our 16-token blocks, so it runs
only where no cached prefix is read: when every sequence of a step starts at position 0, the
step's own contiguous K/V are all the attention needs. Decode steps, steps with a cached
prefix (chunked prefill, prefix hits) and steps with draft trees go to the Triton kernels.
"""
from __future__ import annotations

import torch

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from sluice.engine.attention.triton_backend import TritonAttentionBackend
from sluice.kernels.kv_store import kv_store
from sluice.kernels.paged_decode import paged_decode


def load_flash_attn_varlen(device: torch.device):
    """flash-attn's ``flash_attn_varlen_func``, or ValueError saying why it cannot run here."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend=flash_attn needs a CUDA device, got {device}")
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:
        raise ValueError(
            "attention_backend=flash_attn needs the flash-attn package (pip install 'sluice-llm[gpu]'); "
            f"importing it failed: {exc}"
        ) from exc
    return flash_attn_varlen_func


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_trees = True     # through the Triton kernel

    def __init__(self, device: torch.device) -> None:
        self._varlen = load_flash_attn_varlen(device)

    def forward(self, query, key, value, kv_cache: KVCache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None):
        if softcap is not None:
            raise ValueError("attention_backend=flash_attn: attention soft-capping is not supported (its decode "
                             "runs on the Triton kernels; attention_backend=torch applies it)")
        key_cache, value_cache = kv_cache
        kv_store(key, value, key_cache, value_cache, meta.slot_mapping)
        if meta.is_pure_decode and query.shape[0] == meta.num_seqs:
            return paged_decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                max_seq_len=meta.max_seq_len, window=window)
        if meta.query_lens_cpu != meta.seq_lens_cpu or query.dtype == torch.float32 or meta.tree is not None:
            # A cached prefix to read, fp32 (which flash-attn lacks) or draft trees: the Triton kernel.
            return TritonAttentionBackend.extend(query, kv_cache, meta, scale, window)
        return self._varlen(
            query, key, value,
            cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_query_len,
            softmax_scale=scale, causal=True,
            # flash-attn's (left, right) reach: a query sees window - 1 earlier keys and itself.
            **({} if window is None else {"window_size": (window - 1, 0)}),
        )
