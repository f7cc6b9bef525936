"""Counters, gauges and latency histograms of one engine, in one small dataclass.

The engine owns an ``EngineStats`` and calls its ``on_*`` hooks from its own
thread; the async front end adds its refusals. Readers (``/metrics``,
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

if TYPE_CHECKING:
    from tokenmill.scheduler.request import Request
    from tokenmill.scheduler.output import SchedulerOutput
    from tokenmill.scheduler.scheduler import Progress

# Bucket upper bounds in seconds (vLLM's).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


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


@dataclass
class _Seq:
    """Timing of one engine sequence (a child request)."""

    request: Request
    parent: _Parent
    running: bool = False
    scheduled: bool = False
    last_token: float | None = None


@dataclass
class _Parent:
    """A user request: n child sequences, finished when all are."""

    request_id: str
    arrival: float
    num_left: int
    started: bool = False
    timed_out: bool = False
    reasons: list[str] = field(default_factory=list)


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
    _seqs: dict[str, _Seq] = field(default_factory=dict, repr=False)
    _parents: dict[str, _Parent] = field(default_factory=dict, repr=False)

    @property
    def refused(self) -> int:
        return self.refused_queue_full + self.refused_queue_timeout + self.refused_draining

    # -- hooks called by the engine, on its thread ---------------------------------
    def on_added(self, request_id: str, children: list[Request]) -> None:
        parent = _Parent(request_id, arrival=min(c.arrival_time for c in children), num_left=len(children))
        self._parents[request_id] = parent
        for child in children:
            self._seqs[child.request_id] = _Seq(child, parent)
        self.submitted += 1
        self.num_waiting += len(children)

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        now = time.monotonic()
        for rid in sched.preempted:
            self.num_preemptions += 1
            self._set_running(self._seqs.get(rid), False)
        for s in sched.seqs:
            seq = self._seqs.get(s.request.request_id)
            if seq is None:
                continue
            self._set_running(seq, True)
            if not seq.scheduled:
                seq.scheduled = True
                self.prompt_tokens += seq.request.num_prompt_tokens
                if not seq.parent.started:
                    seq.parent.started = True
                    self.queue_time.observe(now - seq.parent.arrival)

    def on_tokens(self, progress: Progress, now: float) -> None:
        """A request got ``num_new`` output tokens this step (one inter-token gap)."""
        seq = self._seqs.get(progress.request.request_id)
        if seq is None:
            return
        self.generation_tokens += progress.num_new
        if seq.last_token is None:
            self.time_to_first_token.observe(now - seq.parent.arrival)
        else:
            self.inter_token_latency.observe(now - seq.last_token)
        seq.last_token = now

    def on_finished(self, child_id: str) -> None:
        """A sequence finished (its status is final); the engine forgets it next."""
        seq = self._seqs.pop(child_id, None)
        if seq is None:
            return
        self._set_running(seq, None)
        parent = seq.parent
        parent.reasons.append(seq.request.status.value)
        parent.num_left -= 1
        if parent.num_left == 0:
            self._finish_parent(parent)

    def mark_timed_out(self, request_id: str) -> None:
        """The request is about to be aborted for waiting too long: count it as refused."""
        parent = self._parents.get(request_id)
        if parent is not None:
            parent.timed_out = True

    def is_started(self, request_id: str) -> bool:
        """Whether any sequence of the request was scheduled (False once it is gone)."""
        parent = self._parents.get(request_id)
        return parent is not None and parent.started

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
        }

    # -- internals --------------------------------------------------------------
    def _set_running(self, seq: _Seq | None, running: bool | None) -> None:
        """Move a sequence between the gauges; None = it left both."""
        if seq is None:
            return
        if seq.running:
            self.num_running -= 1
        else:
            self.num_waiting -= 1
        if running is None:
            return
        seq.running = running
        if running:
            self.num_running += 1
        else:
            self.num_waiting += 1

    def _finish_parent(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        if parent.timed_out:
            self.refused_queue_timeout += 1
            return
        if "error" in parent.reasons:
            self.failed += 1
        elif "cancelled" in parent.reasons:
            self.cancelled += 1
        else:
            self.completed += 1
            self.finished_reasons[parent.reasons[-1]] += 1
            self.e2e_latency.observe(time.monotonic() - parent.arrival)
