"""Request hooks: how features act on requests without branches in the engine loop.

A feature (structured output, a draft proposer, ...) implements the calls it needs;
``LLMEngine`` calls every registered hook at each point, in registration order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.scheduler.request import Request


class RequestHook:
    """No-op defaults; override what the feature needs.

    - ``on_add``: a new sequence, before it is queued;
    - ``before_step``: the running sequences, before the scheduler picks the step (a
      proposer sets ``spec_token_ids`` here);
    - ``after_tokens``: a sequence got ``num_new`` tokens (the last of its outputs);
    - ``on_finish``: a sequence ended (any reason), its blocks already freed.
    """

    def on_add(self, request: Request) -> None:
        pass

    def before_step(self, running: Sequence[Request]) -> None:
        pass

    def after_tokens(self, request: Request, num_new: int) -> None:
        pass

    def on_finish(self, request: Request) -> None:
        pass
