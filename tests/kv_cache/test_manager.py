import pytest

from tokenmill.kv_cache import BlockPool, KVCacheManager


def test_allocation_hands_out_blocks_in_order_and_grows_tables():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("b", 4)  # 1 block
    assert kv.block_table("b") == [2]
    assert kv.allocate_slots("a", 8)  # still 2 blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 9)  # third block
    assert kv.block_table("a") == [0, 1, 3]
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate_slots("a", 4)
    assert not kv.allocate_slots("b", 3)  # needs 2, 1 free
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots("a", 7)  # needs 2 more
    assert kv.block_table("a") == [0, 1]
    kv.check_integrity()


def test_freed_empty_blocks_are_reused_warmest_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 6)  # [0, 1, 2]
    kv.free("a")
    assert kv.num_free_blocks == 4
    # a's blocks hold nothing cached: they come back head first (the request's
    # own order, pages resident), and block 3, never written, comes last.
    kv.allocate_slots("b", 8)
    assert kv.block_table("b") == [0, 1, 2, 3]
    kv.free("b")
    kv.free("b")  # idempotent
    kv.check_integrity()


def test_cached_blocks_are_evicted_only_after_the_empty_ones_lru_first():
    kv = KVCacheManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    kv.allocate_slots("a", 4)  # [0, 1], both full
    kv.commit("a", [1, 2, 3, 4], 4)
    kv.allocate_slots("b", 3)  # [2, 3]: block 3 is a partial tail, never committed
    kv.commit("b", [5, 6, 7], 3)  # commits block 2 only
    kv.free("a")
    kv.free("b")
    pool = kv.pool
    assert pool.num_cached == 3 and kv.num_free_blocks == 5
    kv.allocate_slots("c", 4)  # the two empty blocks first: b's tail, then 4 (never used)
    assert kv.block_table("c") == [3, 4] and pool.num_evictions == 0
    kv.allocate_slots("d", 4)  # then the cached ones, least recently freed first: a's tail, head
    assert kv.block_table("d") == [1, 0] and pool.num_evictions == 2
    assert pool.num_cached == 1  # b's first block is still findable
    kv.check_integrity()


def test_integrity_check_catches_a_leak():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.allocate_slots("a", 2)
    kv.pool.ref_counts[0] = 2
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_block_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(1)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
