from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache"]
