"""Paged KV cache bookkeeping (pure Python): the block pool and the per-request block manager."""
from __future__ import annotations

from sluice.engine.kv_cache.block_manager import KVCacheManager, hash_block_tokens
from sluice.engine.kv_cache.block_pool import BlockPool, BlockPoolStats, KVBlock, num_blocks_for_budget

__all__ = ["BlockPool", "BlockPoolStats", "KVBlock", "KVCacheManager", "hash_block_tokens",
           "num_blocks_for_budget"]
