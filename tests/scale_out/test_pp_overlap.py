"""Pipeline stages overlapping across steps (issue 18): PP=2 keeps two decode steps in
flight over disjoint sequences (``executor/pipelined.py``, ``scheduler/interleave.py``)
and still gives the one-process tokens."""

from __future__ import annotations

import os
import signal
import time

import pytest
from scale_out_models import save_family

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.executor.pipelined import PipelinedExecutor
from tokenmill.scheduler.interleave import StepInterleave

PROMPTS = [[(11 * i + 5 * j) % 250 + 5 for j in range(3 + 4 * i)] for i in range(12)]
MAX_TOKENS = [6 + (5 * i) % 11 for i in range(12)]  # 6..16
ABORTED = "r4"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return save_family("llama_tied", tmp_path_factory.mktemp("ppo") / "m", smollm2_hf_tokenizer)


def _engine(path, **options) -> LLMEngine:
    options = {
        "dtype": "float32",
        "block_size": 4,
        "num_kv_blocks": 32,
        "max_model_len": 96,
        **options,
    }
    return LLMEngine(EngineConfig(model=str(path), **options))


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], logprobs=2, ignore_eos=True)


def _script(engine: LLMEngine) -> dict[str, object]:
    """Half the requests at once, the rest arriving over the next steps, one aborted
    mid-run; the finished outputs by request id."""
    done: dict[str, object] = {}
    for i in range(6):
        engine.add_request(PROMPTS[i], _params(i), f"r{i}")
    steps, later = 0, list(range(6, 12))
    while engine.has_unfinished() or later:
        if later and steps % 2 == 1:  # arrivals while steps are in flight
            i = later.pop(0)
            engine.add_request(PROMPTS[i], _params(i), f"r{i}")
        if steps == 7:
            engine.abort(ABORTED)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        steps += 1
        assert steps < 1000
    return done


def _alone(engine: LLMEngine, i: int):
    engine.add_request(PROMPTS[i], _params(i), f"alone{i}")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                result = out.outputs[0]
    return result


def _overlapped(events) -> int:
    """Steps whose successor's inputs were sent before their last stage ran."""
    at = {e: k for k, e in enumerate(events)}
    return sum(
        1
        for kind, n in events
        if kind == "ran" and at.get(("sent", n + 1), 1 << 30) < at[(kind, n)]
    )


def test_overlapped_pp2_equals_one_process(llama_dir):
    ref = _engine(llama_dir)
    try:
        want = _script(ref)
    finally:
        ref.shutdown()
    pp = _engine(llama_dir, pipeline_parallel_size=2, async_scheduling="on")
    try:
        assert isinstance(pp.executor, PipelinedExecutor)
        assert isinstance(pp.scheduler.interleave, StepInterleave)
        single = _alone(pp, 3)  # batched equals single, in the same engine
        got = _script(pp)
        assert pp.scheduler.num_preemptions > 0  # 32 blocks of 4 tokens: the pool is short
        assert _overlapped(pp.executor.driver.events) > 0
    finally:
        pp.shutdown()
    assert ABORTED not in got and ABORTED not in want
    assert sorted(got) == sorted(want) and len(got) == 11
    for rid, out in want.items():
        mine = got[rid]
        assert mine.token_ids == out.token_ids, rid
        for a, b in zip(mine.logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert single.token_ids == got["r3"].token_ids


def test_decode_steps_overlap_only_with_the_interleave(llama_dir):
    """The driver's event log: with overlap, step t + 1's inputs are out before step t's
    last stage runs; with async scheduling off (on CPU: auto) the stages take turns."""
    counts = {}
    for mode in ("on", "off"):
        engine = _engine(llama_dir, pipeline_parallel_size=2, async_scheduling=mode)
        try:
            for i in range(4):
                engine.add_request(PROMPTS[i], _params(i), f"r{i}")
            while engine.has_unfinished():
                engine.step()
            counts[mode] = _overlapped(engine.loaded.model.events)  # the PipelineDriver
            kind = type(engine.executor)
        finally:
            engine.shutdown()
        assert (kind is PipelinedExecutor) == (mode == "on") and issubclass(kind, MultiprocExecutor)
    assert counts["off"] == 0
    assert not EngineConfig(model=str(llama_dir), pipeline_parallel_size=2).overlaps_steps()
    assert counts["on"] >= 5  # every decode step of the two groups, bar the first/last


def test_a_dead_stage_fails_requests_in_flight_cleanly(llama_dir):
    engine = _engine(llama_dir, pipeline_parallel_size=2, async_scheduling="on")
    try:
        for i in range(6):
            engine.add_request(PROMPTS[i], SamplingParams(temperature=0, max_tokens=50), f"r{i}")
        for _ in range(6):  # decoding, two steps in flight
            engine.step()
        assert engine.executor._open
        os.kill(engine.executor.ranks.workers.procs[0].pid, signal.SIGKILL)
        started, errors = time.monotonic(), {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    errors[out.request_id] = out.error
            assert time.monotonic() - started < 30
        assert len(errors) == 6
        assert all(e is not None and "worker rank 1" in e for e in errors.values()), errors
    finally:
        engine.shutdown()
