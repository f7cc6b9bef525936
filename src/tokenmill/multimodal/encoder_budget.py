"""The scheduler's per-step encoder budget: how many media tokens one step may encode.

A step whose chunks start many images would run their encoders back to back before any
token of the batch, stalling the text-only requests in it. The scheduler asks ``cap``
for each chunk of a request with media: an item whose placeholder run starts inside the
chunk is charged its token count; once the step's budget would be exceeded the chunk
ends just before that item (it starts in a later step). The first item of a step always
fits, so every request makes progress; a run the encoder already started (a chunk that
begins inside it) costs nothing.

Text first: a step in which a text-only request still has prompt to prefill encodes
nothing new (images wait one step; their text before the image still runs), so text
requests arriving with images get their first token without waiting for an encoder. Two
such steps never follow each other, so a stream of text requests can not starve images.

Whole runs: a request whose runs attend bidirectionally (``MultiModalInputs.bidirectional``,
Gemma 3) never has a chunk end inside a run, since a run's first tokens need its last
ones' keys in the same forward. The chunk ends before the run; a chunk that starts inside
one (its prefix came from the cache) reaches its end or waits. The boundary refuses runs
longer than a step's chunk can be (``check_whole_runs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import MultiModalInputs

if TYPE_CHECKING:
    from tokenmill.scheduler.request import Request


class EncoderBudget:
    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.left = tokens_per_step
        self._charged: set[tuple[str, int]] = set()
        """(request id, item) charged in this step: a chunk may be asked for twice."""

        self._deferred = False
        """The previous step encoded nothing new for text's sake."""

    def reset(self, text_pending: bool = False) -> None:
        """A new step; ``text_pending``: a text-only request has prompt left to prefill."""
        defer = text_pending and not self._deferred
        self._deferred = defer
        self.left = 0 if defer else self.tokens_per_step
        self._charged.clear()

    def cap(self, req: Request, n: int) -> int:
        """The request's next chunk of ``n`` tokens, cut before the first item that does
        not fit what is left of this step's budget (0: nothing this step)."""
        mm = req.mm_inputs
        if mm is None:
            return n
        start = req.num_computed_tokens
        if mm.bidirectional:
            n = whole_runs(mm, start, n)
        for j, (r, item) in enumerate(zip(mm.ranges, mm.items)):
            if r.offset < start or (req.request_id, j) in self._charged:
                continue  # begun in an earlier chunk, or charged in this step already
            if r.offset >= start + n:
                break
            fresh = self.left == self.tokens_per_step  # (0 left in a text-first step)
            if item.num_tokens > self.left and not fresh:
                return r.offset - start
            self.left -= item.num_tokens
            self._charged.add((req.request_id, j))
        return n


def whole_runs(mm: MultiModalInputs, start: int, n: int) -> int:
    """Tokens [start, start + n) cut so that no run ends past the chunk: before a run the
    chunk began, or 0 when the chunk starts inside a run it can not finish."""
    end = start + n
    for r in mm.ranges:
        if r.offset < end < r.end:
            return r.offset - start if r.offset > start else 0
    return n


def check_whole_runs(mm: MultiModalInputs, max_chunk: int) -> None:
    """A bidirectional run must fit one prefill chunk (else it could never be scheduled)."""
    longest = max((r.length for r in mm.ranges), default=0)
    if mm.bidirectional and longest > max_chunk:
        raise InvalidRequestError(
            f"an image takes {longest} tokens that must be prefilled in one step, over the "
            f"step's chunk limit of {max_chunk}: raise max_num_batched_tokens (and "
            "long_prefill_token_threshold, if set) to at least that"
        )


def text_prefill_pending(*queues: Iterable[Request]) -> bool:
    """Whether a text-only request has prompt tokens left to compute."""
    return any(r.mm_inputs is None and r.num_computed_tokens < r.num_prompt_tokens
               for q in queues for r in q)  # fmt: skip
