"""Cache groups: paged blocks and state slots behind the paged manager's API."""

import pytest
import torch

from tokenmill.kv_cache import KVCacheCoordinator, KVCacheManager, make_kv_cache
from tokenmill.kv_cache.spec import (
    CrossAttention,
    FullAttention,
    NoCache,
    RecurrentState,
    SlidingWindow,
    allocate_caches,
    bytes_per_block,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.request import Request, RequestStatus

F32 = torch.float32
FULL = FullAttention(2, 8, F32)
STATE = RecurrentState((16,), F32)


def hybrid(num_blocks=8, block_size=2, num_slots=2, prefix=True) -> KVCacheCoordinator:
    kv = make_kv_cache([FULL, STATE, FULL], num_blocks, block_size, prefix, num_slots=num_slots)
    assert isinstance(kv, KVCacheCoordinator)
    return kv


def test_attention_only_models_get_the_manager_itself():
    kv = make_kv_cache([FULL, SlidingWindow(2, 8, F32, window=4), FULL], 8, 4)
    assert type(kv) is KVCacheManager
    assert kv.state_slot("a") == -1


def test_paged_layers_of_different_shapes_are_refused():
    with pytest.raises(NotImplementedError, match="block table per group"):
        make_kv_cache([FULL, FullAttention(4, 8, F32)], 8, 4)


def test_groups_follow_the_layers():
    kv = make_kv_cache([FULL, STATE, NoCache(), FULL], 8, 4, num_slots=2)
    assert [(g.kind, g.layers) for g in kv.groups] == [
        ("paged", (0, 3)), ("slots", (1,)), ("none", (2,)),
    ]  # fmt: skip


def test_slots_come_with_blocks_and_go_with_them():
    kv = hybrid(num_slots=2)
    assert kv.allocate_slots("a", 3)  # 2 blocks + slot 0
    assert kv.allocate_slots("b", 1)  # 1 block + slot 1
    assert (kv.block_table("a"), kv.state_slot("a")) == ([0, 1], 0)
    assert (kv.block_table("b"), kv.state_slot("b")) == ([2], 1)
    assert kv.allocate_slots("a", 5)  # more blocks, same slot
    assert (kv.block_table("a"), kv.state_slot("a")) == ([0, 1, 3], 0)
    kv.check_integrity()
    kv.free("a")
    assert kv.state_slot("a") == -1 and kv.slots.num_free == 1
    assert kv.allocate_slots("c", 1)
    assert kv.state_slot("c") == 0  # the lowest free slot again
    kv.check_integrity()


def test_allocation_is_all_or_nothing_over_both_groups():
    kv = hybrid(num_blocks=4, num_slots=1)
    assert kv.allocate_slots("a", 2)
    assert not kv.allocate_slots("b", 2)  # blocks enough, no slot free
    assert kv.block_table("b") == [] and kv.num_free_blocks == 3
    assert not kv.allocate_slots("a", 11)  # slot held, too few blocks
    assert kv.block_table("a") == [0] and kv.state_slot("a") == 0
    kv.free("b")
    kv.check_integrity()
    assert kv.usage == 1.0  # the one slot is taken: admission is full


def test_prefix_reuse_is_the_minimum_over_groups():
    tokens = list(range(1, 10))
    plain = make_kv_cache([FULL], 8, 2)
    kv = hybrid(num_blocks=8)
    for cache in (plain, kv):
        assert cache.get_computed_blocks("a", tokens) == 0
        assert cache.allocate_slots("a", 9)
        cache.commit("a", tokens, 9)
        cache.free("a")
    assert plain.get_computed_blocks("b", tokens) == 8  # attention alone reuses 4 blocks
    assert kv.get_computed_blocks("b", tokens) == 0  # a recurrent state can not
    assert kv.block_table("b") == [] and not kv.enable_prefix_caching
    kv.free("b")
    kv.check_integrity()


def test_rejected_drafts_roll_the_blocks_and_the_slot_count_back():
    """The runner copies the state kept after the accepted drafts into the slot
    (``worker/state_rollback.py``); the coordinator rolls its bookkeeping back."""
    kv = hybrid()
    assert kv.allocate_slots("a", 7)  # 4 blocks of 2
    kv.truncate("a", 7)  # nothing rejected: nothing changes
    assert kv.slots.num_tokens("a") == 7 and len(kv.block_table("a")) == 4
    kv.truncate("a", 3)
    assert kv.slots.num_tokens("a") == 3 and len(kv.block_table("a")) == 2
    assert kv.state_slot("a") == 0
    kv.check_integrity()


def test_integrity_check_catches_a_slot_held_twice():
    kv = hybrid()
    kv.allocate_slots("a", 1)
    kv.allocate_slots("b", 1)
    kv.slots._held["b"] = kv.slots._held["a"]
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_tensors_and_sizes_per_spec():
    specs = [FULL, STATE, NoCache(), CrossAttention(2, 8, 5, torch.bfloat16)]
    caches = allocate_caches(specs, num_blocks=3, block_size=4, num_slots=2, device="cpu")
    assert caches[0].shape == (2, 3, 4, 2, 8) and caches[1].shape == (2, 16)
    assert caches[2] is None and caches[3].shape == (2, 2, 5, 2, 8)
    assert caches[3].dtype == torch.bfloat16 and not caches[1].any()
    assert bytes_per_block(specs, 4) == 2 * 4 * 2 * 8 * 4  # paged layers only


def _req(rid: str, n_prompt: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=8)
    return Request(rid, list(range(1, n_prompt + 1)), params, 8, frozenset({0}))


def _step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: 7 for s in out.seqs if s.samples})
    return out


def test_a_request_waits_for_a_free_slot():
    kv = hybrid(num_blocks=16, num_slots=1)
    sched = Scheduler(SchedulerConfig(4, 32, 64), kv)
    sched.add(_req("a", 3))
    sched.add(_req("b", 3))
    assert [s.request.request_id for s in _step(sched).seqs] == ["a"]  # b: no slot left
    assert kv.state_slot("a") == 0 and kv.state_slot("b") == -1
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    out = _step(sched)
    assert [(s.request.request_id, s.start) for s in out.seqs] == [("b", 0)]
    assert kv.state_slot("b") == 0
    kv.check_integrity()


def test_preemption_frees_the_slot_and_recomputes_into_a_new_one():
    """4 blocks of 2 tokens: a and b take 2 each; a's next token needs a fifth block, so b
    (the latest) is preempted: blocks and slot back, recomputed from token 0 later."""
    kv = hybrid(num_blocks=4, block_size=2, num_slots=2)
    sched = Scheduler(SchedulerConfig(4, 32, 64), kv)
    a, b = _req("a", 4), _req("b", 4)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert (kv.state_slot("a"), kv.state_slot("b")) == (0, 1)
    out = _step(sched)
    assert out.preempted == ("b",) and kv.state_slot("b") == -1
    assert b.num_computed_tokens == 0 and kv.slots.num_free == 1
    kv.check_integrity()
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    out = _step(sched)
    assert [(s.request.request_id, s.start) for s in out.seqs] == [("b", 0)]
    assert kv.state_slot("b") == 0  # the lowest free slot: a's old one
    kv.check_integrity()
