"""One request's structured-output state: its spec, its matcher, and the reasoning gate.

With a reasoning parser, the grammar constrains only the answer: the tokens
between the reasoning markers (``<think>`` ... ``</think>``) are free. A request
whose prompt ends inside an open reasoning block starts in ``REASONING``; any
other starts ``UNDECIDED``: its first token may open a reasoning block (the start
marker is allowed on top of the grammar's mask) or begin the answer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenmill.structured_output.backend import GrammarMatcher
from tokenmill.structured_output.params import GrammarSpec


class Phase(enum.Enum):
    REASONING = "reasoning"
    """Inside the reasoning block: unconstrained until the end marker."""
    UNDECIDED = "undecided"
    """No token yet: the grammar's first token, or the reasoning start marker."""
    CONSTRAINED = "constrained"
    """The grammar decides every token."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """Token ids of the reasoning block's delimiters (from the reasoning parser)."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def open_in(self, token_ids: Sequence[int]) -> bool:
        """The ids end inside a reasoning block (its start marker came after the last end)."""
        return _last(token_ids, self.start) > _last(token_ids, self.end)


class StepResult(enum.Enum):
    CONTINUE = "continue"
    COMPLETE = "complete"
    """The grammar is complete: the request stops."""
    REJECTED = "rejected"
    """The grammar did not accept the token (a bug or a conflicting option)."""


@dataclass(eq=False)
class StructuredRequest:
    """Lives on ``Request.structured``; the engine thread is its only user."""

    spec: GrammarSpec
    markers: ReasoningMarkers | None = None
    phase: Phase = Phase.CONSTRAINED
    matcher: GrammarMatcher | None = None
    """None while the grammar compiles (the request is not scheduled meanwhile)."""
    num_accepted: int = 0
    """Tokens the matcher consumed (what ``rollback`` may undo)."""

    @classmethod
    def start(
        cls, spec: GrammarSpec, markers: ReasoningMarkers | None, prompt_token_ids: Sequence[int]
    ) -> StructuredRequest:
        if markers is None:
            return cls(spec)
        phase = Phase.REASONING if markers.open_in(prompt_token_ids) else Phase.UNDECIDED
        return cls(spec, markers, phase)

    @property
    def masks(self) -> bool:
        """This step's token is constrained (otherwise the row is left alone)."""
        return self.phase is not Phase.REASONING

    @property
    def extra_allowed(self) -> int | None:
        """A token allowed on top of the grammar's mask this step (the reasoning opener)."""
        if self.phase is Phase.UNDECIDED and self.markers and len(self.markers.start) == 1:
            return self.markers.start[0]
        return None

    def advance(self, output_token_ids: Sequence[int]) -> StepResult:
        """Account for the newest output token."""
        assert self.matcher is not None, "scheduled before its grammar compiled"
        token = output_token_ids[-1]
        if self.phase is Phase.REASONING:
            if self.markers and _ends_with(output_token_ids, self.markers.end):
                self.phase = Phase.CONSTRAINED
            return StepResult.CONTINUE
        if self.phase is Phase.UNDECIDED:
            if token == self.extra_allowed:
                self.phase = Phase.REASONING
                return StepResult.CONTINUE
            self.phase = Phase.CONSTRAINED
        if not self.matcher.accept_token(token):
            return StepResult.REJECTED
        self.num_accepted += 1
        return StepResult.COMPLETE if self.matcher.is_terminated() else StepResult.CONTINUE

    @property
    def takes_drafts(self) -> bool:
        """Drafts can be checked: the grammar decides every token (not while reasoning, nor
        before the first token, which may open a reasoning block)."""
        return self.phase is Phase.CONSTRAINED and self.matcher is not None

    def valid_drafts(self, drafts: Sequence[int]) -> list[int]:
        """The longest prefix of ``drafts`` the grammar allows, stopping before a draft
        that would complete it (the completing token must be a step's last: a token after
        it would be one the plain output never has). The matcher ends where it started."""
        assert self.matcher is not None
        consumed = kept = 0
        for token in drafts[: self.matcher.validate_tokens(drafts)]:
            accepted = self.matcher.accept_token(token)
            assert accepted, "validate_tokens allowed it"
            consumed += 1
            if self.matcher.is_terminated():
                break
            kept = consumed
        if consumed:
            self.matcher.rollback(consumed)
        return list(drafts[:kept])

    def fill_draft_masks(
        self, drafts: Sequence[int], fill: Callable[[GrammarMatcher, int], None], row: int
    ) -> None:
        """Rows row .. row + len(drafts): the mask before each draft and after the last,
        each with the drafts before it accepted (then rolled back)."""
        assert self.matcher is not None
        for j, token in enumerate(drafts):
            fill(self.matcher, row + j)
            accepted = self.matcher.accept_token(token)
            assert accepted, "drafts are checked by valid_drafts before they are scheduled"
        fill(self.matcher, row + len(drafts))
        if drafts:
            self.matcher.rollback(len(drafts))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (speculative decoding's rejected drafts)."""
        assert self.matcher is not None and num_tokens <= self.num_accepted
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens


def _ends_with(ids: Sequence[int], suffix: Sequence[int]) -> bool:
    n = len(suffix)
    return n > 0 and len(ids) >= n and tuple(ids[-n:]) == tuple(suffix)


def _last(ids: Sequence[int], marker: Sequence[int]) -> int:
    """Index of the last occurrence of ``marker`` in ``ids`` (-1 if none)."""
    n = len(marker)
    if n == 0:
        return -1
    first = marker[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and tuple(ids[i : i + n]) == tuple(marker):
            return i
    return -1
