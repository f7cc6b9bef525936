"""Steps that take turns over disjoint sequences, so pipeline stages overlap (issue 18).

With pipeline stages the engine keeps two steps in flight (``engine/pipeline.py``, the
asynchronous-scheduling loop): step t + 1's inputs go to stage 0 while the last stage
still runs and samples step t (``executor/pipelined.py``). Step t + 1 can then not hold a
sequence whose token step t is still sampling: stage 0 needs its input id now. So each
step skips the sequences with a token in flight and takes at most ceil(n / 2) sequences
(n: the live ones, up to ``max_num_seqs``). The running sequences fall into two
alternating groups by themselves ("virtual engines"), each group's next step needing only
its own sampled tokens; arrivals join the step that has room, and a finished sequence's
place goes to the next one.

Two groups, not one per stage: the engine loop keeps two steps in flight, so with more
than two stages two of them work on decode steps at once. A request whose sampling reads
its tokens so far (penalties, a grammar: ``Scheduler.num_sync_only``) makes the engine
drain every step; steps are then whole again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.scheduler.request import Request
    from tokenmill.scheduler.scheduler import Scheduler

STEPS_IN_FLIGHT = 2
"""The engine loop's depth: the step being launched and the one being collected."""


@dataclass(frozen=True)
class StepInterleave:
    """The scheduler's rule with pipeline stages: no sequence with a token in flight, and
    at most ``cap`` sequences a step. ``Scheduler.schedule`` asks it twice a step (and
    not at all on one process): which running sequences may run, how many may enter."""

    groups: int = STEPS_IN_FLIGHT

    def cap(self, scheduler: Scheduler) -> int:
        """Most sequences the next step may take (at least 1)."""
        limit = scheduler.config.max_num_seqs
        if scheduler.num_sync_only:  # the engine drains every step: nothing overlaps
            return limit
        live = min(len(scheduler.running) + len(scheduler.waiting), limit)
        return max(1, -(-live // self.groups))

    def ready(self, scheduler: Scheduler) -> list[Request]:
        """The running sequences the step may take, best first: those with no token in
        flight, at most ``cap``."""
        ready = [r for r in scheduler.running if not r.num_placeholders]
        return ready[: self.cap(scheduler)]

    def admissions(self, scheduler: Scheduler, scheduled: int) -> int:
        """The running count up to which waiting requests may enter, the step holding
        ``scheduled`` sequences so far."""
        room = max(0, self.cap(scheduler) - scheduled)
        return min(scheduler.config.max_num_seqs, len(scheduler.running) + room)
