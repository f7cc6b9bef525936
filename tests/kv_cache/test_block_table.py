"""The KV manager's block-table array mirrors its per-request lists through every change."""

from __future__ import annotations

import random

import numpy as np

from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_cache.block_table import BlockTableArray


def test_rows_grow_and_come_back_zeroed():
    tables = BlockTableArray(width=2, rows=1)
    a, b = tables.acquire(), tables.acquire()  # the second doubles the rows
    assert (a, b) == (0, 1) and tables.array.shape == (2, 2)
    tables.write(b, 0, [5, 6, 7])  # past the width: doubles it
    assert tables.width == 4 and tables.array[b].tolist() == [5, 6, 7, 0]
    tables.release(b)
    assert tables.acquire() == b and not tables.array[b].any()


def test_gather_pads_and_clips_to_the_output_width():
    tables = BlockTableArray(width=3)
    r0, r1 = tables.acquire(), tables.acquire()
    tables.write(r0, 0, [4, 9, 2])
    tables.write(r1, 0, [8])
    wide = np.full((2, 5), -1, dtype=np.int64)
    tables.gather([r1, r0], wide)
    assert wide.tolist() == [[8, 0, 0, 0, 0], [4, 9, 2, 0, 0]]
    narrow = np.full((1, 2), -1, dtype=np.int64)
    tables.gather([r0], narrow)
    assert narrow.tolist() == [[4, 9]]


def test_manager_keeps_rows_equal_to_lists_under_random_traffic():
    """Admissions with prefix hits, growth, preemption-like frees: after every change the
    array rows equal the lists (``check_integrity`` compares them)."""
    rng = random.Random(0)
    kv = KVCacheManager(
        num_blocks=40, block_size=4, enable_prefix_caching=True, max_blocks_per_seq=2
    )
    shared = [rng.randrange(100) for _ in range(12)]
    live: dict[str, list[int]] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            rid = f"r{step}"
            tokens = shared[: rng.randrange(1, 12)] + [
                rng.randrange(100) for _ in range(rng.randrange(1, 6))
            ]
            computed = kv.get_computed_blocks(rid, tokens)
            if kv.allocate_slots(rid, len(tokens)):
                live[rid] = tokens
                kv.commit(rid, tokens, len(tokens))
            else:
                kv.free(rid)
            assert computed <= len(tokens) - 1
        elif op < 0.8 and live:
            rid = rng.choice(sorted(live))
            tokens = live[rid] + [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
            if kv.allocate_slots(rid, len(tokens)):
                live[rid] = tokens
                kv.commit(rid, tokens, len(tokens))
        elif live:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
        for rid in live:
            table, row = kv.table_and_row(rid)
            assert kv.tables.array[row][: len(table)].tolist() == table
    assert kv.tables.width > 2  # tables outgrew the initial width
