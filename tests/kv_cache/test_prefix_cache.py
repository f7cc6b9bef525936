"""Prefix cache bookkeeping with toy sizes: exact block ids, hits, eviction order."""

from __future__ import annotations

from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_cache import prefix as prefix_mod

BS = 4


def run(
    kv: KVCacheManager, rid: str, tokens: list[int], reuse: bool = True, key: bytes = b""
) -> int:
    """Admit a request, 'compute' all its tokens, commit them. Returns the reused count."""
    hit = kv.get_computed_blocks(rid, tokens, key, reuse)
    assert kv.allocate_slots(rid, len(tokens))
    kv.commit(rid, tokens, len(tokens), key)
    return hit


def test_second_request_reuses_full_blocks_and_keeps_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = list(range(10))  # blocks [0..3] [4..7] + 2 tokens
    assert run(kv, "a", a) == 0
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.pool.num_cached == 2  # only full blocks are committed
    b = list(range(8)) + [99, 98, 97]
    assert run(kv, "b", b) == 8
    assert kv.block_table("b")[:2] == [0, 1]  # shared
    assert kv.pool.ref_counts[0] == 2
    # exactly two full blocks: the last one is recomputed for its logits
    assert run(kv, "c", list(range(8))) == 4
    kv.check_integrity()
    assert kv.stats.queries == 3 and kv.stats.hits == 2
    assert kv.stats.matched_tokens == 16 and kv.stats.reused_tokens == 12


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    run(kv, "a", list(range(8)))  # blocks 0, 1 committed
    kv.free("a")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached == 2
    # free queue: 2, 3 (never used), then a's tail 1, then head 0
    assert kv.pool.free_block_ids() == [2, 3, 1, 0]
    assert kv.allocate_slots("x", 3 * BS)  # takes 2, 3 and evicts 1
    assert kv.block_table("x") == [2, 3, 1]
    assert kv.pool.num_evictions == 1 and kv.pool.num_cached == 1
    assert kv.get_computed_blocks("y", list(range(8)) + [5]) == 4  # block 0 still hits
    assert kv.block_table("y") == [0]
    kv.check_integrity()


def test_salt_and_opt_out_isolate():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run(kv, "a", list(range(9)), key=b"tenant-1")
    assert run(kv, "b", list(range(9)), key=b"tenant-2") == 0
    assert run(kv, "c", list(range(9)), key=b"tenant-1") == 8
    assert run(kv, "d", list(range(9)), reuse=False, key=b"tenant-1") == 0
    kv.check_integrity()


def test_hash_collisions_never_serve_wrong_blocks(monkeypatch):
    monkeypatch.setattr(prefix_mod, "block_hash", lambda parent, tokens, extra=b"": b"same" * 4)
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", [1, 2, 3, 4, 5])
    assert run(kv, "b", [9, 9, 9, 9, 5]) == 0  # same hash, other tokens: no hit
    assert run(kv, "c", [1, 2, 3, 4, 6]) == 4
    kv.check_integrity()


def test_parent_must_match_too():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    # second block's tokens equal, but after another first block: no hit on it
    assert run(kv, "b", [3, 3, 3, 3, 2, 2, 2, 2, 0]) == 0


def test_disabled_and_reset():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    run(kv, "a", list(range(9)))
    assert run(kv, "b", list(range(9))) == 0 and kv.pool.num_cached == 0
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", list(range(9)))
    kv.free("a")
    assert kv.reset_prefix_cache() == 2
    assert run(kv, "b", list(range(9))) == 0
    kv.check_integrity()
