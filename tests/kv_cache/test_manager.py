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


def test_free_returns_blocks_tail_first_and_fifo():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 6)  # [0, 1, 2]
    kv.free("a")
    assert kv.num_free_blocks == 4
    # free queue is now 3, 2, 1, 0: block 3 was never used and comes first,
    # then a's tail before its head.
    kv.allocate_slots("b", 8)
    assert kv.block_table("b") == [3, 2, 1, 0]
    kv.free("b")
    kv.free("b")  # idempotent
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
