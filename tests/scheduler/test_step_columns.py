"""Steps as columns: the scheduler builds a step's sequences as parallel lists, the decode
hot path (runner, ``Scheduler.update``, the engine) reads only those, and ``ScheduledSeq``
records are made from them only when asked for, equal to what the scheduler used to build."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kv_cache import KVCacheManager
from tokenmill.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SeqColumns,
    StepTokens,
)
from tokenmill.scheduler import output as output_module
from tokenmill.scheduler.request import Request

PROMPTS = [[(5 * i + j) % 300 + 7 for j in range(4 + (i * 7) % 19)] for i in range(8)]


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(prompt), params, max_tokens, frozenset({0}))


def test_records_equal_the_columns():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=20), kv)
    reqs = [request(f"r{i}", p) for i, p in enumerate(PROMPTS[:4])]
    for r in reqs:
        sched.add(r)
    reqs[1].spec_token_ids = [3, 4]  # ignored: its prompt is not computed yet
    out = sched.schedule()
    c = out.cols
    assert out._seqs is None, "the scheduler builds columns, not records"
    seqs = out.seqs
    assert [s.request for s in seqs] == list(c.requests)
    assert [s.start for s in seqs] == c.starts and [s.num_new_tokens for s in seqs] == c.num_new
    assert [s.samples for s in seqs] == c.samples and sum(c.samples) == c.num_sampling
    for s in seqs:
        table, row = kv.table_and_row(s.request.request_id)
        assert list(s.block_table) == table and s.table_row == row >= 0
        assert len(table) == -(-s.end // 4)  # what StepColumns sizes the table width from
    # budget 20: the first prompts whole, the last one cut (a chunk that does not sample)
    assert out.num_tokens == 20 and not c.samples[-1] and c.samples[0]
    assert out.seqs is seqs  # made once


def test_columns_of_hand_built_records_round_trip():
    r = request("a", [1, 2, 3])
    seqs = (
        ScheduledSeq(r, 0, 3, [5], True, -1, (9, 8), (-1, 0)),
        ScheduledSeq(request("b", [4]), 0, 1, [6], False),
    )
    out = SchedulerOutput(seqs)
    c = out.cols
    assert c.drafts == {0: (9, 8)} and c.parents == {0: (-1, 0)} and c.num_sampling == 1
    assert out.has_drafts and not c.is_decode and out.num_tokens == 4
    again = SchedulerOutput(
        cols=SeqColumns.of(seqs), table_of=lambda rid: [5] if rid == "a" else [6]
    )
    assert again.seqs == seqs
    with pytest.raises(AssertionError):
        SchedulerOutput(seqs, cols=c)


def test_step_tokens_read_as_lists():
    flat = StepTokens(flat=[4, 5, 6])
    assert len(flat) == 3 and flat[1] == [5] and list(flat) == [[4], [5], [6]]
    assert flat == [[4], [5], [6]] and flat[1:] == [[5], [6]]
    lists = StepTokens([[1, 2], [], [3]])
    assert lists.flat is None and lists[0] == [1, 2] and lists == [[1, 2], [], [3]]


def test_update_of_a_flat_decode_step_equals_lists():
    """One token per sequence read from the flat list gives what per-sequence lists give,
    an EOS and max_tokens ending requests inside the step."""
    finals = []
    for make_tokens in (lambda ids: StepTokens(flat=ids), lambda ids: [[t] for t in ids]):
        kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(), kv)
        reqs = [request(f"r{i}", p, max_tokens=3 + i) for i, p in enumerate(PROMPTS[:4])]
        reqs[2].params = SamplingParams(max_tokens=6, temperature=0.0)  # stops at EOS
        for r in reqs:
            sched.add(r)
        step = 0
        while sched.has_unfinished():
            out = sched.schedule()
            ids = [
                0 if (r.request_id == "r2" and step == 2) else 10 + step for r in out.cols.requests
            ]
            progress = sched.update(out, make_tokens(ids))
            assert list(progress) == [(r, 1) for r in out.cols.requests]
            kv.check_integrity()
            step += 1
        finals.append([(r.output_token_ids, r.status) for r in reqs])
    assert finals[0] == finals[1]
    assert finals[0][2][0] == [10, 11, 0]  # the EOS ended it


def test_decode_hot_path_makes_no_records(tiny_llama_dir, monkeypatch):
    """A steady decode batch (penalties, logprobs, stop strings on, asynchronous scheduling)
    never asks for ``ScheduledSeq`` records: the scheduler, the runner's input building
    and sampling, ``update`` and the engine read the columns. Prompt steps may."""
    made: list[int] = []

    class Counted(ScheduledSeq):
        __slots__ = ()

        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)

    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["zzz"]),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    for mode in ("off", "on"):
        with LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=mode) as llm:
            want = llm.generate(prompts, params)
            made.clear()
            monkeypatch.setattr(output_module, "ScheduledSeq", Counted)
            engine = llm.engine
            ids = [engine.add_request(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]
            engine.step()  # the prompts
            prompt_records = len(made)
            done = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
            monkeypatch.setattr(output_module, "ScheduledSeq", ScheduledSeq)
            assert len(made) == prompt_records, f"{mode}: decode steps made records"
            assert [done[i] for i in ids] == [w.outputs[0].token_ids for w in want]
