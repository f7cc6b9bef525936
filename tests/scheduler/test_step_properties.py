"""Property tests: the scheduler, the KV manager and the step pipeline through thousands
of random steps (arrivals, aborts, preemption, prefix hits, placeholder tokens of
overlapped steps, multi-token accepts and rejected draft tails), without a model
(``model_free``). Integrity is checked after every step; every request that ends on its
own must have produced exactly its reference output."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from model_free import EOS, ModelFreeExecutor

from tokenmill.engine.pipeline import StepPipeline
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_cache.manager import blocks_needed
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.request import Request, RequestStatus

BLOCK = 4
MAX_LEN = 96
PREFIXES = [list(range(100 + 20 * i, 100 + 20 * i + 12)) for i in range(3)]


class Run:
    def __init__(self, rng: random.Random, overlap: bool, drafts: int, corrupt: float,
                 num_blocks: int, budget: int, eos_every: int) -> None:  # fmt: skip
        self.rng, self.overlap, self.drafts, self.corrupt = rng, overlap, drafts, corrupt
        self.kv = KVCacheManager(num_blocks, BLOCK, True, max_blocks_per_seq=MAX_LEN // BLOCK)
        self.sched = Scheduler(SchedulerConfig(6, budget, MAX_LEN, rng.choice([None, 5])), self.kv)
        self.model = ModelFreeExecutor(MAX_LEN, BLOCK, eos_every)
        self.pipeline = StepPipeline(self.model)
        self.live: dict[str, Request] = {}
        self.ended: list[Request] = []
        self.counter = 0

    # -- random events ----------------------------------------------------------------
    def arrive(self) -> None:
        rng = self.rng
        prompt = [
            *rng.choice(PREFIXES)[: rng.randrange(1, 13)],
            *rng.sample(range(3, 90), rng.randrange(0, 9)),
        ]
        max_tokens = rng.randrange(1, 30)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        req = Request(f"r{self.counter}", prompt, params, max_tokens, frozenset({EOS}))
        req.reuse_context = rng.random() < 0.8
        self.counter += 1
        self.live[req.request_id] = req
        self.sched.add(req)

    def abort(self) -> None:
        rid = self.rng.choice(sorted(self.live))
        self.sched.finish(rid, RequestStatus.FINISHED_ABORTED)
        self.ended.append(self.live.pop(rid))

    def propose(self) -> None:
        for req in self.sched.running:
            if req.num_placeholders or req.num_drafts_in_flight or self.rng.random() < 0.3:
                continue
            seq = self.model.sequence(req.prompt_token_ids)
            n = req.num_tokens
            drafts = seq[n : n + self.rng.randrange(1, self.drafts + 1)]
            req.spec_token_ids = [t + 1 if self.rng.random() < self.corrupt else t for t in drafts]

    # -- one engine step ----------------------------------------------------------------
    def step(self) -> None:
        if not self.overlap:
            self.apply(self.pipeline.drain())
        if self.drafts:
            self.propose()
        out = self.sched.schedule()
        if out.is_empty:
            self.apply(self.pipeline.drain())
        else:
            keep = self.overlap and self.sched.has_unfinished()
            self.apply(self.pipeline.launch(out, keep_in_flight=keep))
        self.check()

    def apply(self, results) -> None:
        for result in results:
            assert result.error is None, result.error
            for req, _ in self.sched.update(result.sched, result.output.tokens):
                if req.is_finished:
                    self.ended.append(self.live.pop(req.request_id))

    # -- invariants ---------------------------------------------------------------------
    def check(self) -> None:
        self.kv.check_integrity()
        for req in self.live.values():
            assert not req.is_finished
            held = len(self.kv.block_table(req.request_id))
            assert (
                req.num_computed_tokens
                <= req.num_tokens_with_placeholders + req.num_drafts_in_flight
            )
            assert 0 <= req.num_placeholders <= 2
            if req.status is RequestStatus.RUNNING:
                assert held == blocks_needed(req.num_computed_tokens, BLOCK)  # rollback frees
            else:
                assert held == 0 and req.num_computed_tokens == 0
        for req in self.ended:
            assert self.kv.block_table(req.request_id) == []
        assert self.sched.num_sync_only == 0

    def finish_all(self) -> None:
        for _ in range(5000):
            if not (self.sched.has_unfinished() or self.pipeline.busy):
                break
            self.step()
        assert not self.live and self.kv.num_free_blocks == self.kv.num_blocks

    def check_outputs(self) -> None:
        for req in self.ended:
            if req.status is RequestStatus.FINISHED_ABORTED:
                continue
            ref = self.model.sequence(req.prompt_token_ids)[req.num_prompt_tokens :]
            expected = ref[: req.max_tokens]
            if EOS in expected:
                expected = expected[: expected.index(EOS) + 1]
            assert req.output_token_ids == expected, req.request_id


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    overlap=st.booleans(),
    drafts=st.sampled_from([0, 1, 3, 6]),
    corrupt=st.sampled_from([0.0, 0.2, 0.7]),
    num_blocks=st.integers(MAX_LEN // BLOCK, 60),
    budget=st.sampled_from([8, 16, 64]),
    eos_every=st.sampled_from([0, 20]),
)
def test_random_steps_keep_every_invariant(
    seed, overlap, drafts, corrupt, num_blocks, budget, eos_every
):
    rng = random.Random(seed)
    run = Run(rng, overlap, drafts, corrupt, num_blocks, budget, eos_every)
    for _ in range(150):
        if rng.random() < 0.35:
            run.arrive()
        if run.live and rng.random() < 0.04:
            run.abort()
        run.step()
    run.finish_all()
    run.check_outputs()


def test_the_random_runs_exercise_what_they_claim():
    """One fixed run shows the events happen: preemption, prefix hits, accepted and
    rejected drafts, overlapped steps (a placeholder at scheduling time)."""
    rng = random.Random(1)
    run = Run(rng, overlap=True, drafts=4, corrupt=0.3, num_blocks=30, budget=16, eos_every=0)
    accepted = rejected = placeholders = 0
    real_update = run.sched.update

    def update(out, tokens):
        nonlocal accepted, rejected, placeholders
        for s, new in zip(out.seqs, tokens):
            if s.draft_token_ids and new:
                accepted += len(new) - 1
                rejected += len(s.draft_token_ids) - (len(new) - 1)
        return real_update(out, tokens)

    real_schedule = run.sched.schedule

    def schedule():
        nonlocal placeholders
        out = real_schedule()
        placeholders += sum(s.end - len(s.draft_token_ids) > s.request.num_tokens for s in out.seqs)
        return out

    run.sched.update, run.sched.schedule = update, schedule
    for _ in range(400):
        if rng.random() < 0.3:
            run.arrive()
        run.step()
    run.finish_all()
    run.check_outputs()
    assert run.sched.num_preemptions > 0 and run.kv.stats.hits > 0
    assert accepted > 0 and rejected > 0 and placeholders > 0
