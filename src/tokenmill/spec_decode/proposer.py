"""Draft proposals: a ``Proposer`` guesses a request's next tokens; the step verifies them.

``DraftHook`` asks the proposer before every step for each running request that can take
drafts, and leaves them in ``Request.spec_token_ids``; the scheduler schedules them after
the request's last token, the runner samples at each of their positions, and the
scheduler keeps the accepted prefix and rolls back the rest (``Scheduler.update``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenmill.engine.hooks import RequestHook
from tokenmill.scheduler.request import Request


class Proposer(Protocol):
    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses of the tokens after ``request.all_token_ids``."""
        ...


class DraftHook(RequestHook):
    """Fills ``spec_token_ids`` of running requests from a proposer, at most
    ``num_tokens`` per step. Requests in their prefill, with a token still in flight, or
    with a grammar get none (see ``Scheduler._num_drafts``)."""

    def __init__(self, proposer: Proposer, num_tokens: int) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens

    def before_step(self, running: Sequence[Request]) -> None:
        for req in running:
            if (
                req.num_placeholders or req.num_drafts_in_flight or req.structured is not None
                or req.num_computed_tokens < req.num_tokens - 1  # still prefilling
            ):  # fmt: skip
                continue
            req.spec_token_ids = self.proposer.propose(req, self.num_tokens)[: self.num_tokens]
