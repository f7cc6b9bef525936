"""Schedules tokens, not phases.

Every step: running requests first (best priority, then earliest), then
waiting ones in the same order, under a token budget and a sequence cap. A
request that cannot get KV blocks makes the worst running request (lowest
priority, latest) give its blocks back: preemption by recompute. A preempted
request returns to the waiting queue in its original place and later
recomputes its prompt and the tokens it had generated (much of which the
prefix cache usually still holds).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.kv_cache import KVCacheManager
from tokenmill.multimodal.encoder_budget import EncoderBudget, text_prefill_pending
from tokenmill.scheduler.interleave import StepInterleave
from tokenmill.scheduler.output import SchedulerOutput, SeqColumns
from tokenmill.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from tokenmill.kv_cache.coordinator import KVCacheCoordinator


@dataclass(slots=True)
class _StepBuilder:
    """The requests chosen for a step so far and their token counts (parallel lists)."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Progress:
    """Event record of ``Scheduler.update``: the requests that got new tokens and how many
    each (the last that many of its outputs), as two parallel lists. Iterating gives
    (request, n) pairs."""

    requests: list[Request] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[Request, int]]:
        return zip(self.requests, self.counts)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    max_model_len: int = 8192
    """Longest sequence (prompt + output) a request may reach."""
    long_prefill_token_threshold: int | None = None
    """Largest prefill chunk of one request in one step (None: the whole budget)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | KVCacheCoordinator) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_sync_only = 0
        """Live requests whose sampling reads their tokens so far (penalties, min_tokens,
        a grammar): while there are any, steps must not overlap."""
        self._arrivals = itertools.count()
        self.encoder_budget: EncoderBudget | None = None
        """Media tokens one step may encode (``multimodal/encoder_budget.py``); None for a
        text-only model."""
        self.interleave: StepInterleave | None = None
        """With pipeline stages overlapping across steps (``scheduler/interleave.py``): a
        step takes no sequence with a token in flight, and at most half of them. None:
        every ready sequence may run."""

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_index = next(self._arrivals)
        self.requests[request.request_id] = request
        self.num_sync_only += request.params.reads_output_tokens
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop, abort, fail) a request wherever it is; frees its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.num_sync_only -= req.params.reads_output_tokens
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
        if self.encoder_budget is not None:  # a model with a media encoder
            self.encoder_budget.reset(text_prefill_pending(self.waiting, self.running))
        step = _StepBuilder()
        preempted: list[str] = []
        allocate = self.kv.allocate_slots
        interleave = self.interleave  # pipeline stages: a part of the running (interleave.py)
        max_running = self.config.max_num_seqs
        running = list(self.running) if interleave is None else interleave.ready(self)
        for req in running:  # (per request per step: kept to plain attribute reads)
            if budget == 0:
                break
            if preempted and req.request_id in preempted:  # preempted earlier in this loop
                continue
            if req.num_drafts_in_flight or (
                req.num_placeholders and self._ends_with_placeholders(req)
            ):
                continue
            left = len(req.all_token_ids) + req.num_placeholders - req.num_computed_tokens
            n = 1 if left == 1 and not req.spec_token_ids else self._chunk(req, budget)
            if n == 0:  # its next chunk starts an image the step's encoder budget can not take
                continue
            if not allocate(req.request_id, req.num_computed_tokens + n) and not (
                self._preempt_until_fits(req, n, preempted)
            ):
                continue
            step.requests.append(req)
            step.num_new.append(n)
            budget -= n
        first: list[Request] = []
        if not preempted:
            if interleave is not None:  # the step's other places, if any
                max_running = interleave.admissions(self, len(step.requests))
            self._admit_waiting(budget, step, preempted, first, max_running)
        return SchedulerOutput(
            None, tuple(preempted), self.kv.tables, tuple(first),
            cols=self._columns(step), table_of=self.kv.block_table,
        )  # fmt: skip

    def _columns(self, step: _StepBuilder) -> SeqColumns:
        """Record each chunk as computed now (the model runs it before anything reads the
        count again) and, when it reaches the last token, one more token as a placeholder
        (and the drafts it carries as in flight). Drafts are consumed either way. One pass
        over the chosen requests, appending to columns: no object per sequence."""
        starts: list[int] = []
        samples: list[bool] = []
        rows: list[int] = []
        drafts: dict[int, tuple[int, ...]] = {}
        parents: dict[int, tuple[int, ...]] = {}
        row_of = self.kv.table_row
        num_sampling = 0
        for i, (req, n) in enumerate(zip(step.requests, step.num_new)):
            start = req.num_computed_tokens
            known_end = len(req.all_token_ids) + req.num_placeholders
            sample = start + n >= known_end
            if req.spec_token_ids:
                if sample:
                    taken = tuple(req.spec_token_ids[: start + n - known_end])
                    req.num_drafts_in_flight = len(taken)
                    if taken:
                        drafts[i] = taken
                    if req.spec_parents is not None and taken:  # a tree: its first nodes
                        parents[i] = tuple(req.spec_parents[: len(taken)])
                req.spec_token_ids = []
                req.spec_parents = None
            req.num_computed_tokens = start + n
            req.num_placeholders += sample
            num_sampling += sample
            starts.append(start)
            samples.append(sample)
            rows.append(row_of(req.request_id))
        return SeqColumns(
            tuple(step.requests), starts, step.num_new, rows, samples, drafts, parents,
            num_sampling,
        )  # fmt: skip

    def _ends_with_placeholders(self, req: Request) -> bool:
        """The tokens in flight will end the request by length whatever they are: nothing
        to schedule (only with asynchronous scheduling is a token in flight here)."""
        return req.num_placeholders > 0 and (
            req.num_output_tokens + req.num_placeholders >= req.max_tokens
            or req.num_tokens_with_placeholders >= self.config.max_model_len
        )

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to compute this step: the unknown part of the sequence, then its drafts
        (those that fit before max_tokens and max_model_len), within the budget."""
        n = min(req.num_tokens_with_placeholders - req.num_computed_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        n = min(n, cap) if cap else n
        if req.mm_inputs is not None and self.encoder_budget is not None:
            n = self.encoder_budget.cap(req, n)
        if req.spec_token_ids and n == req.num_tokens_with_placeholders - req.num_computed_tokens:
            n += min(self._num_drafts(req), budget - n)
        return n

    def _num_drafts(self, req: Request) -> int:
        """Drafts the step may verify: none after a placeholder (its id is not on the host,
        so nothing could be drafted after it); the step yields at most drafts + 1 tokens,
        which must fit max_tokens and max_model_len. (A grammar's drafts were checked by
        its matcher when proposed: ``StructuredRequest.valid_drafts``.)"""
        if req.num_placeholders:
            return 0
        room = min(
            req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens
        )
        return max(0, min(len(req.spec_token_ids), room - 1))

    def _preempt_until_fits(self, req: Request, n: int, preempted: list[str]) -> bool:
        """Get blocks for n more tokens of a running request (which did not get them),
        preempting from the back; False when it was the one preempted."""
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
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _admit_waiting(
        self,
        budget: int,
        step: _StepBuilder,
        preempted: list[str],
        first: list[Request],
        max_running: int,
    ) -> None:
        scheduled = {r.request_id for r in step.requests}
        while self.waiting and budget > 0 and len(self.running) < max_running:
            req = self.waiting[0]
            if req.num_placeholders:  # preempted here with its token in flight: it comes
                break  # back once the token landed (an interleave preempts those first)
            if not self._admit(req, budget, scheduled, preempted):
                break
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = req.num_computed_tokens
                first.append(req)
            bisect.insort(self.running, req, key=lambda r: r.sort_key)
            n = self._chunk(req, budget)
            step.requests.append(req)
            step.num_new.append(n)
            scheduled.add(req.request_id)
            budget -= n

    def _admit(self, req: Request, budget: int, scheduled: set[str], preempted: list[str]) -> bool:
        """Give a waiting request its cached prefix and blocks for its first chunk.

        A better-priority request may preempt worse running ones that were not
        scheduled in this step. All or nothing: on failure it holds no blocks.
        """
        assert req.num_placeholders == 0, "a preempted request comes back once its token landed"
        reuse = req.reuse_context and req.params.prompt_logprobs is None
        req.num_computed_tokens = self.kv.get_computed_blocks(
            req.request_id, req.all_token_ids, req.cache_key, reuse
        )
        n = self._chunk(req, budget)
        if n == 0:  # an image the step's encoder budget can not take: a later step
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            return False
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1] if self.running else None
            if victim is None or victim.sort_key <= req.sort_key or victim.request_id in scheduled:
                self.kv.free(req.request_id)
                req.num_computed_tokens = 0
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
        return True

    # -- after the model ran ---------------------------------------------------
    def update(self, out: SchedulerOutput, tokens: Sequence[Sequence[int]]) -> Progress:
        """Apply a step's results: ``tokens[i]`` are the new tokens of sequence i (none
        when it did not sample; else its accepted drafts and one more token). Rejected
        drafts are rolled back (``num_computed_tokens`` and KV blocks), full blocks are
        cached, and tokens are appended one by one until a token-level stop, which cuts
        the rest. Returns the requests that got tokens, with how many. A decode step's
        tokens may come as one flat list (``StepTokens.flat``): no list per sequence."""
        c = out.cols
        flat = getattr(tokens, "flat", None) if not c.drafts else None
        if flat is not None and len(flat) == c.num_sampling == len(c.requests):
            return self._apply_decode(c, flat)
        progressed = Progress()
        for i, (req, new) in enumerate(zip(c.requests, tokens)):
            if req.is_finished:  # aborted, or ended by the step before (async scheduling)
                continue
            self._apply(req, c, i, new, progressed)
        return progressed

    def _apply_decode(self, c: SeqColumns, flat: list[int]) -> Progress:
        """``update`` of a step in which every sequence sampled one token (no drafts)."""
        kv, caching = self.kv, self.kv.enable_prefix_caching
        max_model_len = self.config.max_model_len
        got: list[Request] = []
        for req, token, start, n in zip(c.requests, flat, c.starts, c.num_new):
            if req.is_finished:  # aborted, or ended by the step before (async scheduling)
                continue
            req.num_placeholders -= 1
            # Preempted while in flight: the token counts, its KV is gone anyway.
            if caching and req.status is not RequestStatus.WAITING:
                kv.commit(req.request_id, req.cacheable_tokens, start + n, req.cache_key)
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            status = req.check_stop(max_model_len)
            if status is not None:
                self.finish(req.request_id, status)
            got.append(req)
        return Progress(got, [1] * len(got))

    def _apply(
        self, req: Request, c: SeqColumns, i: int, new: Sequence[int], progressed: Progress
    ) -> None:
        """``update`` of sequence i of a step with drafts, prompt chunks or preemptions."""
        # Preempted while the step was in flight (it waits, holding no blocks, until this
        # result lands): its tokens count, its KV is gone anyway.
        preempted = req.status is RequestStatus.WAITING
        end = c.starts[i] + c.num_new[i]
        if c.samples[i]:
            req.num_placeholders -= 1
            req.num_drafts_in_flight = 0
            rejected = len(c.drafts.get(i, ())) - (len(new) - 1)
            if rejected and not preempted:
                end -= rejected
                req.num_computed_tokens -= rejected
                self.kv.truncate(req.request_id, req.num_computed_tokens)
        if not preempted:
            self.kv.commit(req.request_id, req.cacheable_tokens, end, req.cache_key)
        if not new:
            return
        count = 0
        for token in new:
            req.append_token(token)
            count += 1
            status = req.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish(req.request_id, status)
                break
        progressed.requests.append(req)
        progressed.counts.append(count)

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()
