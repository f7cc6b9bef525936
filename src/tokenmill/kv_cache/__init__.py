"""Paged KV cache bookkeeping: which blocks each request holds (the tensors live in the runner)."""

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
