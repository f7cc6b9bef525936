"""Schedules tokens, not phases.

Every step: running requests first (in admission order), then waiting ones
FCFS, under a token budget and a sequence cap. A request that cannot get KV
blocks makes the most recently admitted running request give its blocks back
(preemption by recompute); a preempted request goes back to the front of the
waiting queue and later recomputes its prompt and the tokens it had generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv_cache import KVCacheManager
from tokenmill.scheduler.output import ScheduledSeq, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) a request may reach."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, abort, fail) a request wherever it is; frees its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(request_id)
        return req

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        preempted: list[str] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, preempted):
                continue
            chosen.append((req, n))
            budget -= n
        if not preempted:
            budget = self._admit_waiting(budget, chosen)
        seqs = tuple(
            ScheduledSeq(
                request=req,
                start=req.num_computed_tokens,
                num_new_tokens=n,
                block_table=tuple(self.kv.block_table(req.request_id)),
                samples=req.num_computed_tokens + n == req.num_tokens,
            )
            for req, n in chosen
        )
        return SchedulerOutput(seqs=seqs, preempted=tuple(preempted))

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Get blocks for n more tokens of a running request, preempting from the back."""
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: int, chosen: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chosen.append((req, n))
            budget -= n
        return budget

    # -- after the model ran ---------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish on token-level stops.

        Returns the requests that got a new token this step.
        """
        progressed: list[Request] = []
        for seq in out.seqs:
            req = seq.request
            if req.is_finished:  # aborted between schedule and update
                continue
            req.num_computed_tokens = seq.end
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.append_token(token)
            progressed.append(req)
            status = req.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish(req.request_id, status)
        return progressed
