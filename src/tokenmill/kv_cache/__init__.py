"""Paged KV cache bookkeeping: which blocks (and state slots) each request holds (the
tensors live in the runner)."""

from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.coordinator import KVCacheCoordinator, make_kv_cache
from tokenmill.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheCoordinator", "KVCacheManager", "make_kv_cache"]
