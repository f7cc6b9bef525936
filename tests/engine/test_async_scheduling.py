"""Asynchronous scheduling (step N+1 launched before step N is waited for) gives exactly
the outputs of synchronous stepping: early stops, preemption, aborts, sampling, logprobs,
and the requests that force synchronous steps. (The padded decode path with pending
tokens: tests/worker/test_padded_decode.py.)"""

from __future__ import annotations

import pytest
from faults import fail_launch

from tokenmill import LLM, SamplingParams
from tokenmill.scheduler.request import RequestStatus
from tokenmill.structured_output.params import StructuredOutputsParams

PROMPTS = [[(7 * i + j) % 4000 + 10 for j in range(3 + (i * 5) % 23)] for i in range(12)]


def make(model_dir, mode: str, **kw) -> LLM:
    opts = dict(dtype="float32", max_model_len=64, num_kv_blocks=80, block_size=4,
                max_num_batched_tokens=48, check_kv_integrity=True)  # fmt: skip
    return LLM(str(model_dir), async_scheduling=mode, **(opts | kw))


def count_pending(llm: LLM, monkeypatch) -> list[int]:
    """How many input tokens each step took from the device (the overlap happening);
    none may while a request that needs synchronous steps is live."""
    counts: list[int] = []
    runner = llm.engine.runner
    real = runner._pending_tokens

    def spy(seqs, cols=None):
        pending = real(seqs, cols)
        counts.append(0 if pending is None else len(pending.seqs))
        assert pending is None or not llm.engine.scheduler.num_sync_only
        return pending

    monkeypatch.setattr(runner, "_pending_tokens", spy)
    return counts


def run_both(model_dir, prompts, params, monkeypatch, **kw):
    """(sync outputs, async outputs, pending counts of the async run)."""
    with make(model_dir, "off", **kw) as sync:
        assert not sync.engine.overlap
        expected = sync.generate([{"prompt_token_ids": p} for p in prompts], params)
    with make(model_dir, "on", **kw) as llm:
        assert llm.engine.overlap
        counts = count_pending(llm, monkeypatch)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        engine = llm.engine
        assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks
    return expected, got, counts


def assert_same(expected, got) -> None:
    for e, g in zip(expected, got, strict=True):
        for a, b in zip(e.outputs, g.outputs, strict=True):
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.token_ids,
                a.text,
                a.finish_reason,
                a.stop_reason,
            )


def test_greedy_batch_with_preemption_matches_sync(tiny_llama_dir, monkeypatch):
    params = [
        SamplingParams(temperature=0, max_tokens=12 + i % 9, ignore_eos=True) for i in range(12)
    ]
    expected, got, counts = run_both(tiny_llama_dir, PROMPTS, params, monkeypatch, num_kv_blocks=40)
    assert_same(expected, got)
    assert max(counts) >= 6, "the steps never overlapped"


def test_early_stops_match_sync(tiny_llama_dir, monkeypatch):
    """EOS-like stop tokens and stop strings end requests while their next step is already
    in flight: that step's token is dropped, the outputs are unchanged."""
    with make(tiny_llama_dir, "off") as probe:
        free = probe.generate([{"prompt_token_ids": p} for p in PROMPTS[:6]],
                              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))  # fmt: skip
    params = []
    for i, out in enumerate(free):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        if i % 2:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[3 + i]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop=[text[5:8]]))
    expected, got, _ = run_both(tiny_llama_dir, PROMPTS[:6], params, monkeypatch)
    assert_same(expected, got)
    assert all(o.outputs[0].finish_reason == "stop" for o in got)


def test_seeded_sampling_logprobs_and_n_match_sync(tiny_llama_dir, monkeypatch):
    params = [
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            seed=i,
            max_tokens=10,
            logprobs=3,
            n=1 + i % 2,
            ignore_eos=True,
        )  # fmt: skip
        for i in range(8)
    ]
    expected, got, counts = run_both(tiny_llama_dir, PROMPTS[:8], params, monkeypatch)
    assert_same(expected, got)
    for e, g in zip(expected, got):
        for a, b in zip(e.outputs, g.outputs):
            assert [sorted(p) for p in b.logprobs] == [sorted(p) for p in a.logprobs]
            # The tokens are equal; the float32 sums may differ in their last bits (the
            # two modes batch the rows differently, and MKL's reductions depend on M).
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, rel=1e-6, abs=1e-5)
    assert max(counts) > 0


def test_history_reading_requests_step_synchronously(tiny_llama_dir, monkeypatch):
    """While a request with a grammar is live, no step takes its input tokens from the
    device (``count_pending`` asserts it); the outputs are unchanged."""
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    params = [
        plain,
        SamplingParams(
            temperature=0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),  # fmt: skip
    ]
    for special in params[1:]:
        expected, got, counts = run_both(
            tiny_llama_dir, PROMPTS[:3], [plain, special, plain], monkeypatch
        )
        assert_same(expected, got)
        # Steps before the grammar request leaves its compile hold may overlap (it has
        # nothing in flight); once it is scheduled, none does (``count_pending``).
        assert 0 in counts


def test_penalties_overlap_steps(tiny_llama_dir, monkeypatch):
    """Penalties count the token still in flight on the device: their steps overlap and
    the outputs are those of synchronous steps (greedy and seeded sampling). A bias makes
    one token win until the penalties for its repeats outweigh it, so every output
    depends on exact counts, the in-flight token's included."""
    bias = {500: 12.0}
    common = dict(max_tokens=12, ignore_eos=True, logit_bias=bias)
    params = [
        SamplingParams(temperature=0, repetition_penalty=30.0, **common),
        SamplingParams(temperature=0, frequency_penalty=2.0, **common),
        SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=1.0, **common),
        SamplingParams(temperature=0.9, seed=5, frequency_penalty=1.5, **common),
        SamplingParams(temperature=0, **common),
    ]
    expected, got, counts = run_both(tiny_llama_dir, PROMPTS[:5], params, monkeypatch)
    assert_same(expected, got)
    assert max(counts) >= 4  # the penalised rows took their input token from the device
    unpenalised = expected[4].outputs[0].token_ids
    assert unpenalised.count(500) == 12  # without penalties the bias wins every step
    for out in expected[:4]:
        assert 1 <= out.outputs[0].token_ids.count(500) < 12  # the penalties bite


def test_min_tokens_overlaps_steps(tiny_llama_dir, monkeypatch):
    """min_tokens reads only how many tokens came, in flight ones included: its steps
    overlap, and EOS (made likely by a bias) is still held back until min_tokens."""
    params = [
        SamplingParams(temperature=0, max_tokens=10, min_tokens=k, logit_bias={2: 8.0})
        for k in (0, 1, 4, 7)
    ]
    expected, got, counts = run_both(tiny_llama_dir, PROMPTS[:4], params, monkeypatch)
    assert_same(expected, got)
    lengths = [len(o.outputs[0].token_ids) for o in got]
    assert all(n >= k for n, k in zip(lengths, (0, 1, 4, 7)))
    assert lengths[0] < 7 and got[0].outputs[0].finish_reason == "stop"  # the bias bites
    assert max(counts) > 0


def test_abort_while_a_step_is_in_flight(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with make(tiny_llama_dir, "off") as sync:
        expected = sync.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
    with make(tiny_llama_dir, "on") as llm:
        engine = llm.engine
        keep = engine.add_request(PROMPTS[1], params)
        drop = engine.add_request(PROMPTS[2], params)
        finals = {}
        for _ in range(4):
            for out in engine.step():
                finals[out.request_id] = out
        assert engine.pipeline.busy
        aborted = engine.abort(drop)
        assert aborted is not None and aborted.outputs[0].finish_reason == "cancelled"
        while engine.has_unfinished():
            for out in engine.step():
                finals[out.request_id] = out
        assert finals[keep].outputs[0].token_ids == expected
        assert drop not in finals or finals[drop].finished is False
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_ended_requests_leave_nothing_to_wait_for(tiny_llama_dir):
    """Closing a stream (or aborting) while its step is in flight: the engine has nothing
    unfinished, frees every block, and drops the stale step on the next one, including
    the prompt logprobs it computed for the aborted request."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with make(tiny_llama_dir, "on") as llm:
        engine = llm.engine
        stream = llm.generate_stream({"prompt_token_ids": PROMPTS[3]}, greedy)
        next(stream)
        stream.close()
        assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.kv.num_blocks
        rid = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=5, prompt_logprobs=2))
        engine.step()  # the prefill (with its prompt logprobs) is launched, not collected
        assert engine.pipeline.busy
        engine.abort(rid)
        assert not engine.has_unfinished()
        again = llm.generate({"prompt_token_ids": PROMPTS[3]}, greedy)[0].outputs[0]
    with make(tiny_llama_dir, "off") as sync:
        assert (
            again.token_ids
            == sync.generate({"prompt_token_ids": PROMPTS[3]}, greedy)[0].outputs[0].token_ids
        )


def test_a_failing_launch_with_a_step_in_flight(tiny_llama_dir, monkeypatch):
    """The step in flight is still collected (its tokens delivered), the failing step's
    requests end with an error, and the engine serves the next request."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with make(tiny_llama_dir, "on") as llm:
        fail_launch(monkeypatch, llm.engine.runner, call=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
        for out in outs:
            assert out.outputs[0].finish_reason == "error" and "boom" in out.error
            assert len(out.outputs[0].token_ids) == 2  # the steps before the failure
        again = llm.generate({"prompt_token_ids": PROMPTS[0]}, params)[0].outputs[0]
        assert again.finish_reason == "length" and len(again.token_ids) == 8
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_async_scheduling_option(tiny_llama_dir):
    with pytest.raises(ValueError, match="async_scheduling='sometimes' is unknown"):
        make(tiny_llama_dir, "sometimes")
    with make(tiny_llama_dir, "auto") as llm:
        assert not llm.engine.overlap  # CPU: nothing to overlap with


def test_no_step_past_the_length_limit(tiny_llama_dir, monkeypatch):
    """A request whose pending token is its last (max_tokens) is not scheduled again: its
    3 tokens take exactly 3 launches (prefill, 2 decodes), and nothing stays pending."""
    with make(tiny_llama_dir, "on") as llm:
        engine = llm.engine
        launches = []
        real = engine.runner.launch
        monkeypatch.setattr(
            engine.runner, "launch", lambda s: launches.append(len(s.seqs)) or real(s)
        )
        rid = engine.add_request(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
        req = engine.scheduler.requests[rid]
        while engine.has_unfinished():
            engine.step()
    assert launches == [1, 1, 1]
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.num_placeholders == 0 and req.num_output_tokens == 3
