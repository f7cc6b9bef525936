"""Counters, gauges and latency histograms of one engine, in one small dataclass.

The engine owns an ``EngineStats`` and folds into it the event records its stages
return (``SchedulerOutput``: first-scheduled sequences and preemptions; ``Progress``:
new tokens; ``RequestFinished``: a user request's end), from its own thread; the async
front end adds its refusals. No request is mirrored here: per-sequence timing lives on
the scheduler's ``Request``, per-request state on the output processor's parent. Readers (``/metrics``,
``LLM.get_scheduling_metrics``) only read. Invariant: every field has exactly one
writing thread (the engine thread, except ``refused_queue_full`` and
``refused_draining``, written by the server's event loop), so no lock is needed.

Latencies follow vLLM's definitions: queue time = arrival -> first scheduled,
time to first token = arrival -> first output token, inter-token latency = time
between two output tokens of one sequence, end-to-end = arrival -> finished (completed requests only).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenmill.scheduler.output import SchedulerOutput
    from tokenmill.scheduler.scheduler import Progress
    from tokenmill.spec_decode.metrics import SpecDecodeStats

# Bucket upper bounds in seconds (vLLM's).
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on


@dataclass
class Histogram:
    """Observations counted into fixed buckets (upper bounds, seconds) plus +Inf."""

    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    """counts[i]: observations in (buckets[i-1], buckets[i]]; the last one is +Inf."""
    sum: float = 0.0
    count: int = 0
    max: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self.max = max(self.max, value)

    def observe_many(self, values: list[float]) -> None:
        """``observe`` each value; a step's many inter-token gaps in a few array ops."""
        if len(values) < 16:
            for value in values:
                self.observe(value)
            return
        array = np.asarray(values)
        # bisect_left's bucket: the first bound >= value (side="left").
        found = np.bincount(np.searchsorted(self.buckets, array), minlength=len(self.counts))
        for i in np.flatnonzero(found).tolist():
            self.counts[i] += int(found[i])
        self.sum += float(array.sum())
        self.count += len(values)
        self.max = max(self.max, float(array.max()))

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) per bucket, ending with (+inf, count)."""
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), list(self.counts)):
            total += n
            out.append((bound, total))
        return out

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


@dataclass(frozen=True)
class RequestFinished:
    """Event record: a user request (all its n sequences) ended."""

    reasons: tuple[str, ...]
    """Finish reason of each sequence, in the order they ended."""
    arrival: float
    timed_out: bool = False
    """Aborted for waiting past queue_timeout (counted as refused)."""


@dataclass
class EngineStats:
    submitted: int = 0
    """Requests accepted by ``add_request`` (n > 1 counts once)."""
    completed: int = 0
    """Requests whose sequences all finished on stop or length."""
    cancelled: int = 0
    """Requests aborted before finishing (client gone, ``abort``, ``close``)."""
    failed: int = 0
    """Requests failed by an error inside the engine."""
    refused_queue_full: int = 0
    """Refused at once because the waiting queue was full (HTTP 429)."""
    refused_queue_timeout: int = 0
    """Accepted, then dropped because they waited longer than queue_timeout (HTTP 503)."""
    refused_draining: int = 0
    """Refused because the server was shutting down (HTTP 503)."""
    prompt_tokens: int = 0
    """Prompt tokens prefilled (each of n sequences prefills its prompt)."""
    generation_tokens: int = 0
    """Output tokens sampled."""
    num_preemptions: int = 0
    num_waiting: int = 0
    """Sequences waiting to be scheduled (including preempted ones)."""
    num_running: int = 0
    """Sequences holding KV blocks."""
    finished_reasons: Counter[str] = field(default_factory=Counter)
    """Completed requests by the finish reason of their last sequence (stop, length)."""
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's counters (the draft hook's own, shared), None when off."""

    @property
    def refused(self) -> int:
        return self.refused_queue_full + self.refused_queue_timeout + self.refused_draining

    # -- events, folded on the engine thread ----------------------------------------
    def on_added(self) -> None:
        self.submitted += 1

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        self.num_preemptions += len(sched.preempted)
        for req in sched.first_scheduled:
            self.prompt_tokens += req.num_prompt_tokens

    def on_started(self, arrival: float, now: float) -> None:
        """A user request's first sequence was scheduled for the first time."""
        self.queue_time.observe(now - arrival)

    def on_tokens(self, progressed: Progress, now: float) -> None:
        """Each request got its count of output tokens this step (one inter-token gap)."""
        firsts: list[float] = []
        gaps: list[float] = []
        total = sum(progressed.counts)
        for req in progressed.requests:
            last = req.last_token_time
            if last is None:
                firsts.append(now - req.arrival_time)
            else:
                gaps.append(now - last)
            req.last_token_time = now
        self.time_to_first_token.observe_many(firsts)
        self.inter_token_latency.observe_many(gaps)
        self.generation_tokens += total

    def on_request_finished(self, event: RequestFinished) -> None:
        if event.timed_out:
            self.refused_queue_timeout += 1
        elif "error" in event.reasons:
            self.failed += 1
        elif "cancelled" in event.reasons:
            self.cancelled += 1
        else:
            self.completed += 1
            self.finished_reasons[event.reasons[-1]] += 1
            self.e2e_latency.observe(time.monotonic() - event.arrival)

    def set_gauges(self, num_waiting: int, num_running: int) -> None:
        """Sequences waiting (queued, preempted or held) and holding KV blocks."""
        self.num_waiting = num_waiting
        self.num_running = num_running

    # -- reading --------------------------------------------------------------------
    def scheduling_metrics(self) -> dict[str, float | int]:
        """The scheduling counters as a flat dict (``LLM.get_scheduling_metrics``)."""
        return {
            "submitted": self.submitted,
            "refused": self.refused,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "queue_latency_avg_s": self.queue_time.mean,
            "queue_latency_max_s": self.queue_time.max,
            "queued": self.num_waiting,
            "running": self.num_running,
            **(self.spec_decode.as_dict() if self.spec_decode is not None else {}),
        }
