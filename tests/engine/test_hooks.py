"""Request hooks: a feature holds, releases, ends and observes requests without any
branch of its own in the engine loop."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.hooks import Outcome, RequestHook
from tokenmill.errors import InvalidRequestError
from tokenmill.scheduler.request import RequestStatus


class Recorder(RequestHook):
    """Refuses max_tokens=13, holds every request for two steps, stops a request once it
    has three tokens, and records what it saw."""

    def __init__(self) -> None:
        self.held: list = []
        self.readies = 0
        self.events: list[tuple[str, str, int]] = []

    def check(self, params):
        if params.max_tokens == 13:
            raise InvalidRequestError("13 tokens are unlucky")
        return "ctx"

    def on_add(self, request, ctx):
        assert ctx == "ctx"
        self.held.append(request)
        return False

    @property
    def has_held(self):
        return bool(self.held)

    def ready(self):
        self.readies += 1
        if self.readies < 3:
            return [], []
        ready, self.held = self.held, []
        return ready, []

    def discard(self, request_id):
        for req in self.held:
            if req.request_id == request_id:
                self.held.remove(req)
                return req
        return None

    def after_tokens(self, request, num_new):
        self.events.append(("tokens", request.request_id, num_new))
        if request.num_output_tokens == 3:
            return Outcome(RequestStatus.FINISHED_STOPPED)
        return None

    def on_finish(self, request):
        self.events.append(("finish", request.request_id, request.num_output_tokens))


@pytest.fixture
def engine(tiny_llm):
    config = dataclasses.replace(tiny_llm.config, check_kv_integrity=True)
    hook = Recorder()
    return LLMEngine(config, tiny_llm.engine.loaded, hooks=[hook]), hook


def test_a_hook_holds_releases_and_ends_requests(engine):
    engine, hook = engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="unlucky"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=13))
    assert not engine.has_unfinished()  # nothing was queued
    engine.add_request([1, 2, 3], params, "a")
    engine.add_request([4, 5, 6], params, "gone")
    assert engine.has_unfinished() and not engine.scheduler.requests  # held by the hook
    engine.abort("gone")  # a held request is aborted through the hook
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    out = finals["a"].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "stop"
    assert hook.events == [
        ("finish", "gone", 0),
        ("tokens", "a", 1),
        ("tokens", "a", 1),
        ("tokens", "a", 1),
        ("finish", "a", 3),
    ]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
