"""On CUDA the runner's device-to-host copies are non-blocking and ``collect`` waits for one
event; these CPU tests stand a fake event in for CUDA's and check that a step's copies are
always covered by an event that ``collect`` waits on."""

from __future__ import annotations

import torch

from tokenmill import LLM, SamplingParams


class FakeEvent:
    """Records what the runner does with its events (CPU has no CUDA events)."""

    log: list[str] = []

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_prompt_chunk_without_sampling_still_waits_for_its_logprobs(tiny_llama_dir, monkeypatch):
    """A step of prompt chunks only samples nothing, but its prompt logprobs are copied to
    the host non-blocking: collect must wait for them (it read them too early before)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=32,
              block_size=4, long_prefill_token_threshold=4, async_scheduling="off")  # fmt: skip
    try:
        engine, runner = llm.engine, llm.engine.runner
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(runner.host_ids, "pinned", True)  # as on CUDA
        FakeEvent.log = []
        rid = engine.add_request(
            list(range(10, 22)), SamplingParams(max_tokens=2, prompt_logprobs=1)
        )
        sched = engine.scheduler.schedule()
        assert [s.samples for s in sched.seqs] == [False]  # the first 4 of 12 prompt tokens
        step = runner.launch(sched)
        assert step.ids is None and step.done is not None and FakeEvent.log == ["record"]
        out = runner.collect(step)
        assert FakeEvent.log == ["record", "synchronize"]
        start, entries = out.prompt_logprobs[rid]
        assert (
            out.tokens == [[]] and start == 0 and [e.token_id for e in entries] == [11, 12, 13, 14]
        )
        engine.abort(rid)
    finally:
        llm.close()


def test_a_step_that_copies_nothing_records_no_event(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=32,
              block_size=4, long_prefill_token_threshold=4, async_scheduling="off")  # fmt: skip
    try:
        engine, runner = llm.engine, llm.engine.runner
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(runner.host_ids, "pinned", True)
        FakeEvent.log = []
        rid = engine.add_request(list(range(10, 22)), SamplingParams(max_tokens=2))
        step = runner.launch(engine.scheduler.schedule())
        assert step.ids is None and step.done is None
        assert runner.collect(step).tokens == [[]] and FakeEvent.log == []
        engine.abort(rid)
    finally:
        llm.close()
