"""Structured output as a request hook: the engine loop knows nothing of grammars.

The hook validates a request's guide at the boundary, holds the request while its
grammar compiles, starts each step's bitmask while the model runs, masks the logits,
and feeds every new token to the grammar (a complete grammar stops the request, a
rejected token fails it)."""

from __future__ import annotations

from tokenmill.engine.hooks import Outcome, RequestHook
from tokenmill.sampling.logits_processors import RowProcessor
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import SchedulerOutput
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.params import GrammarSpec
from tokenmill.structured_output.state import StepResult


class StructuredOutputHook(RequestHook):
    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        # Asked once per batch composition which rows it masks (``sampling/batch.py``).
        self.logits_processor = RowProcessor(manager.mask_logits, _has_grammar)

    def check(self, params: SamplingParams) -> GrammarSpec | None:
        guide = params.structured_outputs
        return self.manager.validate(guide) if guide is not None else None

    def on_add(self, request: Request, ctx: GrammarSpec | None) -> bool:
        return ctx is None or self.manager.submit(request, ctx)

    def watches(self, request: Request) -> bool:
        return request.structured is not None

    @property
    def has_held(self) -> bool:
        return self.manager.has_waiting

    def ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        return self.manager.collect()

    def wait(self, timeout: float) -> None:
        self.manager.wait(timeout)

    def discard(self, request_id: str) -> Request | None:
        return self.manager.discard(request_id)

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        self.manager.prepare(sched)  # grammar masks compute while the model runs

    def after_tokens(self, request: Request, num_new: int) -> Outcome | None:
        """Feed the new tokens to the grammar (more than one: accepted drafts, each one
        sampled under the mask of the state before it). An EOS or a stop string that
        already stopped the request ends it as is."""
        if request.structured is None or request.status is RequestStatus.FINISHED_STOPPED:
            return None
        outputs = request.output_token_ids
        for end in range(len(outputs) - num_new + 1, len(outputs) + 1):
            result = self.manager.advance(request, end)
            if result is StepResult.COMPLETE:
                return Outcome(RequestStatus.FINISHED_STOPPED)
            if result is StepResult.REJECTED:
                token = outputs[end - 1]
                return Outcome(RequestStatus.FINISHED_ERROR, f"the grammar rejected token {token}")
        return None


def _has_grammar(row) -> bool:
    return row.structured is not None
