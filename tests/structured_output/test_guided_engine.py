"""The engine side of structured output on the tiny random Llama: compiles happen off the
loop (other requests keep going), aborts while compiling, the compile cache, masking."""

from __future__ import annotations

import re
import threading
import uuid

import pytest

from tokenmill import SamplingParams
from tokenmill.structured_output import StructuredOutputsParams as Guide

PROMPT = [1, 504, 3250, 314, 253, 1345]


def _unique_regex() -> str:
    """A spec no other test compiled (the engine's cache is shared across tests)."""
    return "(ab|cd){1,3}" + re.escape(uuid.uuid4().hex[:6])


@pytest.fixture
def gated(tiny_llm, monkeypatch):
    """Compiles wait for the returned event."""
    manager = tiny_llm.engine.structured
    gate = threading.Event()
    real = manager._compile

    def slow(spec):
        assert gate.wait(30)
        return real(spec)

    monkeypatch.setattr(manager, "_compile", slow)
    yield gate
    gate.set()


def test_compiling_never_stalls_other_requests(tiny_llm, gated):
    engine = tiny_llm.engine
    regex = _unique_regex()
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=5), "plain")
    engine.add_request(
        PROMPT,
        SamplingParams(temperature=0, max_tokens=30, structured_outputs=Guide(regex=regex)),
        "guided",
    )
    done = {}
    while "plain" not in done:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert "guided" not in done and engine.has_unfinished() and engine.structured.has_waiting
    gated.set()
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert re.fullmatch(regex, done["guided"].outputs[0].text)
    assert done["guided"].outputs[0].finish_reason == "stop"


def test_abort_while_compiling(tiny_llm, gated):
    engine = tiny_llm.engine
    engine.add_request(
        PROMPT, SamplingParams(structured_outputs=Guide(regex=_unique_regex())), "doomed"
    )
    out = engine.abort("doomed")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "cancelled"
    assert not engine.has_unfinished() and not engine.structured.has_waiting


def test_same_spec_compiles_once(tiny_llm, monkeypatch):
    manager = tiny_llm.engine.structured
    calls = []
    real = manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: calls.append(spec) or real(spec))
    regex = _unique_regex()
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=Guide(regex=regex))
    outs = tiny_llm.generate([{"prompt_token_ids": PROMPT}] * 3, params)
    outs += tiny_llm.generate({"prompt_token_ids": PROMPT}, params)
    assert len(calls) == 1
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs)


def test_random_weights_follow_a_choice_when_sampling(tiny_llm):
    choices = ["first option", "second", "a third one"]
    params = [
        SamplingParams(
            temperature=1.5, seed=i, max_tokens=20, structured_outputs=Guide(choice=choices)
        )
        for i in range(8)
    ]
    outs = tiny_llm.generate([{"prompt_token_ids": PROMPT}] * 8, params)
    assert all(o.outputs[0].text in choices for o in outs)
    mixed = tiny_llm.generate(
        [{"prompt_token_ids": PROMPT}] * 2,
        [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), params[0]],
    )
    assert len(mixed[0].outputs[0].token_ids) == 6  # unconstrained rows are left alone
    assert mixed[1].outputs[0].text in choices


def test_unknown_backend_and_reasoning_parser_are_refused():
    from tokenmill import EngineConfig

    with pytest.raises(ValueError, match="structured_outputs_backend"):
        EngineConfig(structured_outputs_backend="outlines")
    with pytest.raises(ValueError, match="reasoning parser 'nope' is unknown"):
        EngineConfig(reasoning_parser="nope")


def test_grammar_state_survives_preemption(tiny_llm):
    engine = tiny_llm.engine
    before = engine.scheduler.num_preemptions
    regex = "(ab|ba){30}" + re.escape(uuid.uuid4().hex[:4])
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=80, structured_outputs=Guide(regex=regex)
        )
        for i in range(8)
    ]
    # 8 x (19 + 30..64) tokens: more than the 64 blocks x 4 tokens of the tiny engine
    prompts = [{"prompt_token_ids": PROMPT * 3 + [100 + i]} for i in range(8)]
    outs = tiny_llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > before
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outs), [
        o.outputs[0].text for o in outs
    ]
