"""Request hooks: how features act on requests without branches in the engine loop.

A feature (structured output, a draft proposer, ...) implements the calls it needs;
``LLMEngine`` calls every registered hook at each point, in registration order:

    add_request:  check(params) -> ctx  (may raise ValueError: nothing is queued)
                  on_add(request, ctx) -> False holds the request (say, its grammar compiles)
    each step:    ready() -> the held requests that may run now, and those that failed
                  before_step(running)   (a proposer sets spec_token_ids here)
                  on_scheduled(sched)    (start work that overlaps the forward pass)
                  logits processor       (``logits_processor``, joined to the sampler)
                  after_tokens(request, num_new) -> an Outcome that may end the request
    ending:       discard(request_id)    (abort of a held request) / on_finish(request)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.sampling.logits_processors import LogitsProcessor
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.scheduler import SchedulerOutput
    from tokenmill.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class Outcome:
    """What a hook decided after a request's new tokens: end it with ``status`` (a stop
    also turns a length finish into a stop: the request is complete, not cut), with
    ``error`` as its error message."""

    status: RequestStatus
    error: str | None = None


class RequestHook:
    """No-op defaults; override what the feature needs (see the module docstring)."""

    logits_processor: LogitsProcessor | None = None
    """A sampler row processor the feature needs (joined once, when the engine is built)."""

    def check(self, params: SamplingParams) -> Any:
        """Validate the request's parameters for this feature; the result is its context."""
        return None

    def on_add(self, request: Request, ctx: Any) -> bool:
        """A new sequence; False: the hook holds it until ``ready`` hands it back."""
        return True

    @property
    def has_held(self) -> bool:
        return False

    def ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Held sequences that may be scheduled now, and those that failed (with why)."""
        return [], []

    def wait(self, timeout: float) -> None:
        """The engine is idle but for held sequences: block up to ``timeout`` for one."""

    def discard(self, request_id: str) -> Request | None:
        """Forget a held sequence (aborted); returns it, or None if not held here."""
        return None

    def before_step(self, running: Sequence[Request]) -> None:
        pass

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        pass

    def watches(self, request: Request) -> bool:
        """Whether ``after_tokens`` must see this sequence's tokens (asked once, after
        ``on_add``; the loop then calls it only for the sequences that need it)."""
        return type(self).after_tokens is not RequestHook.after_tokens

    def after_tokens(self, request: Request, num_new: int) -> Outcome | None:
        return None

    def on_finish(self, request: Request) -> None:
        pass
