from tokenmill.kv_cache import KVCacheManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.request import Request, RequestStatus


def make(num_blocks=8, block_size=4, budget=16, max_seqs=8, max_len=64):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_seqs, budget, max_len), kv), kv


def req(rid, n_prompt, max_tokens=8):
    return Request(
        rid,
        list(range(1, n_prompt + 1)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
        max_tokens,
        frozenset({0}),
    )


def run_step(sched, token=7):
    out = sched.schedule()
    sched.update(out, [[token] if s.samples else [] for s in out.seqs])
    return out


def test_chunked_prefill_then_decode_under_token_budget():
    sched, kv = make(budget=6)
    a = req("a", 10)
    sched.add(a)
    out = run_step(sched)
    assert [(s.request.request_id, s.start, s.num_new_tokens, s.samples) for s in out.seqs] == [
        ("a", 0, 6, False)
    ]
    out = run_step(sched)
    assert [(s.start, s.num_new_tokens, s.samples) for s in out.seqs] == [(6, 4, True)]
    assert a.output_token_ids == [7]
    out = run_step(sched)
    assert [(s.start, s.num_new_tokens) for s in out.seqs] == [(10, 1)]
    assert kv.block_table("a") == [0, 1, 2]


def test_running_decodes_first_then_waiting_fcfs_in_the_same_step():
    sched, _ = make(budget=8)
    sched.add(req("a", 3))
    run_step(sched)
    sched.add(req("b", 5))
    sched.add(req("c", 5))
    out = run_step(sched)
    # a decodes 1 token, b gets its 5-token prefill, c gets the 2 left of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.seqs] == [
        ("a", 1),
        ("b", 5),
        ("c", 2),
    ]


def test_max_num_seqs_caps_the_batch():
    sched, _ = make(max_seqs=2)
    for r in "abc":
        sched.add(req(r, 2))
    out = run_step(sched)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"]


def test_preemption_recomputes_the_latest_request():
    # 4 blocks of 2 tokens: a and b take 2 blocks each; the next token of a needs a fifth.
    sched, kv = make(num_blocks=4, block_size=2, budget=32)
    a, b = req("a", 4), req("b", 4)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled; each sampled a token -> 5 tokens, 4 computed
    assert kv.num_free_blocks == 0
    out = run_step(sched)
    assert out.preempted == ("b",)
    assert [s.request.request_id for s in out.seqs] == ["a"]
    assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
    assert list(sched.waiting) == [b]
    assert b.output_token_ids == [7]  # generated tokens are kept and recomputed later
    kv.check_integrity()


def test_finish_frees_blocks_and_stops_on_eos_and_length():
    sched, kv = make()
    a = req("a", 3, max_tokens=2)
    sched.add(a)
    run_step(sched)
    run_step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == kv.num_blocks
    b = req("b", 3)
    sched.add(b)
    run_step(sched, token=0)  # eos
    assert b.status is RequestStatus.FINISHED_STOPPED
    assert not sched.has_unfinished()
    kv.check_integrity()


def test_abort_waiting_and_running():
    sched, kv = make()
    a, b = req("a", 3), req("b", 3)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    assert sched.finish("a", RequestStatus.FINISHED_ABORTED) is a
    assert sched.finish("b", RequestStatus.FINISHED_ABORTED) is b
    assert sched.finish("b", RequestStatus.FINISHED_ABORTED) is None
    assert kv.num_free_blocks == kv.num_blocks
    assert sched.schedule().is_empty
