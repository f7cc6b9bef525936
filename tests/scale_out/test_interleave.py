"""The scheduler's rule for pipeline stages overlapping across steps
(``scheduler/interleave.py``), driven as the engine does with two steps in flight:
schedule step t + 1, then apply step t."""

from __future__ import annotations

import random

import pytest

from tokenmill.kv_cache import KVCacheManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.interleave import StepInterleave
from tokenmill.scheduler.request import Request, RequestStatus


def _scheduler(num_blocks: int = 64, max_seqs: int = 8) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_seqs, 64, 128), KVCacheManager(num_blocks, 4))
    sched.interleave = StepInterleave()
    return sched


def _req(rid: str, prompt: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(1, prompt + 1)), params, max_tokens, frozenset({0}))


def _apply(sched: Scheduler, out) -> None:
    sched.update(out, [[7] if s.samples else [] for s in out.seqs])


def _ids(out) -> set[str]:
    return {s.request.request_id for s in out.seqs}


def test_decode_steps_alternate_over_two_halves():
    sched = _scheduler()
    for i in range(6):
        sched.add(_req(f"r{i}", 3, 20))
    steps, in_flight = [], None
    for _ in range(8):  # launch t + 1, then apply t
        out = sched.schedule()
        steps.append(_ids(out))
        if in_flight is not None:
            _apply(sched, in_flight)
        in_flight = out
    assert all(len(s) == 3 for s in steps)  # ceil(6 / 2)
    assert all(not (a & b) for a, b in zip(steps, steps[1:]))  # consecutive: disjoint
    assert steps[2::2] == [steps[0]] * 3 and steps[3::2] == [steps[1]] * 3


def test_without_the_interleave_a_step_takes_every_sequence():
    sched = _scheduler()
    sched.interleave = None
    for i in range(6):
        sched.add(_req(f"r{i}", 3, 20))
    assert len(sched.schedule().seqs) == 6


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_aborts_and_preemption_finish_every_request(seed):
    """Arrivals, aborts and a KV pool too small for all: consecutive steps stay disjoint,
    nothing asserts, every request not aborted gets exactly its max_tokens."""
    rng = random.Random(seed)
    sched = _scheduler(num_blocks=12, max_seqs=6)
    reqs, aborted, in_flight, last = {}, set(), None, set()
    for _ in range(400):
        if len(reqs) < 14 and rng.random() < 0.5:
            rid = f"r{len(reqs)}"
            reqs[rid] = _req(rid, rng.randint(1, 20), rng.randint(1, 12))
            sched.add(reqs[rid])
        if reqs and rng.random() < 0.03:
            rid = rng.choice(sorted(reqs))
            if sched.finish(rid, RequestStatus.FINISHED_ABORTED) is not None:
                aborted.add(rid)
        out = sched.schedule()
        now = {s.request.request_id for s in out.seqs if s.samples}
        assert not (now & last)  # none samples while its token is in flight
        if in_flight is not None:
            _apply(sched, in_flight)
        in_flight, last = (None if out.is_empty else out), now
        if not sched.has_unfinished() and len(reqs) == 14:
            break
    if in_flight is not None:
        _apply(sched, in_flight)
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    for rid, r in reqs.items():
        if rid not in aborted:
            assert r.num_output_tokens == r.max_tokens, rid
