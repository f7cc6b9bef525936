"""Recurrent-state snapshots in the coordinator, on toy specs: which rows a step reserves,
what a lookup resumes from, LRU eviction order, pins, the step's copies and integrity."""

from __future__ import annotations

import torch

from tokenmill.kv_cache import KVCacheCoordinator, make_kv_cache
from tokenmill.kv_cache.snapshot_copies import SnapshotTensors
from tokenmill.kv_cache.snapshots import StateStep, checkpoint_interval, snapshot_rows
from tokenmill.kv_cache.spec import FullAttention, RecurrentState, allocate_caches

F32 = torch.float32
SPECS = [FullAttention(1, 2, F32), RecurrentState((3,), F32)]
BS = 4  # blocks of 4 tokens: snapshots every 64


def coordinator(rows: int = 3, num_blocks: int = 64) -> KVCacheCoordinator:
    kv = make_kv_cache(SPECS, num_blocks, BS, True, max_blocks_per_seq=40, num_slots=2,
                       snapshot_rows=rows)  # fmt: skip
    assert isinstance(kv, KVCacheCoordinator) and kv.snapshots is not None
    return kv


def run(kv: KVCacheCoordinator, rid: str, tokens: list[int], chunk: int = 1000) -> StateStep:
    """Admit, compute the prompt in chunks (each chunk's step taken and committed), then
    free; returns the last step."""
    done = kv.get_computed_blocks(rid, tokens)
    step = StateStep(())
    while done < len(tokens):
        end = min(done + chunk, len(tokens))
        assert kv.allocate_slots(rid, end)
        step = kv.state_step([rid])
        kv.commit(rid, tokens, end)
        kv.check_integrity()
        done = end
    kv.free(rid)
    kv.check_integrity()
    return step


def test_interval_and_rows():
    assert checkpoint_interval(4) == checkpoint_interval(16) == 64
    assert checkpoint_interval(128) == 128
    # row: 3 state floats + a block of K/V (2 x 4 tokens x 1 head x 2) = 12 + 64 bytes
    assert snapshot_rows(SPECS, BS, 76 * 5 + 75, num_slots=2) == 5
    assert snapshot_rows(SPECS, BS, None, num_slots=2) == 0  # 2 slots x 12 bytes < a row
    assert snapshot_rows(SPECS[:1], BS, 10**6, num_slots=2) == 0  # nothing recurrent


def test_a_prompt_reserves_its_interval_positions_and_its_last_token_but_one():
    kv = coordinator(rows=4)
    tokens = list(range(1, 151))
    assert kv.get_computed_blocks("a", tokens) == 0
    assert kv.allocate_slots("a", 150)
    step = kv.state_step(["a"])
    # all inside the chunk: 64, 128 and 149 (inside block 37: its K/V after the forward)
    assert step.run_saves == (((64, 0), (128, 1), (149, 2)),)
    assert step.save_rows == () and step.tail_rows == (2,)
    assert step.tail_blocks == (kv.block_table("a")[37],)
    assert kv.state_step(["a"]).run_saves == ()  # taken once
    kv.commit("a", tokens, 150)
    kv.free("a")
    kv.check_integrity()
    assert kv.snapshots.num_committed == 3


def test_a_lookup_resumes_at_the_longest_snapshot_and_restores_it():
    kv = coordinator(rows=4)
    tokens = list(range(1, 151))
    run(kv, "a", tokens, chunk=50)  # chunk ends 50, 100, 150: saves 64 and 128 inside
    longer = tokens + [7, 8]
    assert kv.get_computed_blocks("b", longer) == 149  # A's end less one: token-granular
    assert kv.block_table("b") == kv.paged.block_table("b")[:37]
    assert kv.allocate_slots("b", 152)  # 149..152, no save: b's end less one is its end
    step = kv.state_step(["b"])
    assert step.restore_slots == (kv.state_slot("b"),)
    assert step.restore_blocks == (kv.block_table("b")[37],)  # the tail's new block
    kv.free("b")
    cut = tokens[:146] + [9]  # shares 36 blocks: no snapshot at 144, resumes at 128
    assert kv.get_computed_blocks("c", cut) == 128
    assert len(kv.block_table("c")) == 32  # the blocks past 128 went back
    assert kv.stats.reused_tokens == 149 + 128
    kv.free("c")
    assert kv.get_computed_blocks("d", tokens[:60]) == 0  # nothing below 64 but A's end
    kv.free("d")
    kv.check_integrity()


def test_lru_eviction_order_and_pins():
    kv = coordinator(rows=2)
    a, b = list(range(1, 71)), list(range(100, 110))
    run(kv, "a", a)  # 64 and 69: both rows
    assert kv.get_computed_blocks("x", a[:66]) == 64  # 64 is now the most recent, pinned
    run(kv, "b", b)  # b's end evicts 69 (least recent), not 64 (pinned, recent)
    assert kv.snapshots.stats.evictions == 1
    assert kv.get_computed_blocks("y", a + [1]) == 64  # 69 is gone: falls back
    kv.free("x")
    kv.free("y")
    assert kv.get_computed_blocks("z", b + [1]) == 9
    kv.free("z")
    kv.check_integrity()


def test_pinned_rows_are_not_evicted_and_freeing_gives_rows_back():
    kv = coordinator(rows=1)
    run(kv, "a", list(range(1, 11)))
    assert kv.get_computed_blocks("b", list(range(1, 13))) == 9  # pins the only row
    assert kv.get_computed_blocks("c", list(range(50, 60))) == 0
    assert kv.allocate_slots("c", 10)  # its end finds no row: no snapshot, no error
    kv.check_integrity()
    kv.free("b")  # admission given up before its step: the pin goes with it
    assert kv.state_step(["c"]).run_saves == ()
    kv.free("c")
    kv.check_integrity()
    assert kv.snapshots.num_committed == 1
    assert kv.get_computed_blocks("d", list(range(50, 62))) == 0
    assert kv.allocate_slots("d", 12)  # unpinned now: evicted for d's end
    assert kv.state_step(["d"]).run_saves == (((11, 0),),)
    kv.commit("d", list(range(50, 62)), 12)
    kv.free("d")
    assert kv.snapshots.stats.evictions == 1 and kv.snapshots.num_committed == 1


def test_copies_move_state_and_tail():
    kv = coordinator(rows=2)
    caches = allocate_caches(SPECS, 64, BS, 2, "cpu")
    snaps = SnapshotTensors(SPECS, caches, 2)
    pages, states = caches
    assert snaps.tensors[0].shape == (2, 2, BS, 1, 2) and snaps.tensors[1].shape == (2, 3)
    tokens = list(range(1, 7))
    kv.get_computed_blocks("a", tokens)
    kv.allocate_slots("a", 5)  # a chunk ending at the last token but one: the slot's state
    step = kv.state_step(["a"])
    assert step.save_rows == (0,) and step.run_saves == ()
    states[0] = torch.tensor([1.0, 2.0, 3.0])
    block = kv.block_table("a")[1]
    pages[:, block] = 5.0
    snaps.save(step, caches)
    kv.commit("a", tokens, 5)
    kv.allocate_slots("a", 6)
    snaps.save(kv.state_step(["a"]), caches)
    kv.commit("a", tokens, 6)
    kv.free("a")
    pages.zero_()
    states.zero_()
    assert kv.get_computed_blocks("b", tokens + [9]) == 5
    kv.allocate_slots("b", 7)
    restore = kv.state_step(["b"])
    snaps.restore(restore, caches)
    assert states[kv.state_slot("b")].tolist() == [1.0, 2.0, 3.0]
    assert (pages[:, kv.block_table("b")[1]] == 5.0).all()
    kv.free("b")


def test_a_state_kept_inside_a_chunk_copies_only_its_tail():
    """The layers write a state kept inside the chunk (``run_saves``) themselves; after the
    forward only its partial block's K/V is copied, never the slot (which holds the state
    after the whole chunk)."""
    kv = coordinator(rows=2)
    caches = allocate_caches(SPECS, 64, BS, 2, "cpu")
    snaps = SnapshotTensors(SPECS, caches, 2)
    pages, states = caches
    tokens = list(range(1, 7))
    kv.get_computed_blocks("a", tokens)
    kv.allocate_slots("a", 6)
    step = kv.state_step(["a"])
    assert step.run_saves == (((5, 0),),) and step.save_rows == ()
    assert step.tail_rows == (0,) and step.tail_blocks == (kv.block_table("a")[1],)
    states[0] = torch.tensor([1.0, 2.0, 3.0])
    pages[:, kv.block_table("a")[1]] = 5.0
    snaps.save(step, caches)
    assert (snaps.tensors[0][0] == 5.0).all()
    assert snaps.tensors[1][0].tolist() == [0.0, 0.0, 0.0]
    kv.free("a")
