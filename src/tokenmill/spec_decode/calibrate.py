"""The verify-cost curve c(T): seconds of one step of T tokens on this engine's runner,
measured once at start-up (a few dozen steps on scratch KV blocks, freed afterwards).

Steps are shaped as speculation shapes them: T <= K + 1 is one sequence verifying T - 1
drafts (what ``t(k)/t(1)`` means); larger T are sequences of K + 1 tokens each. Every
step samples at every token, as a verification does. The KV blocks written are free
and uncommitted before and after, so no request ever reads them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokenmill.kv_cache import KVCacheCoordinator, KVCacheManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.scheduler.request import Request
from tokenmill.spec_decode.adaptive import CostCurve

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CONTEXT = 64
"""Tokens of context behind each measured sequence (a typical short chat's order)."""
REPEATS = 3


def measure_cost_curve(
    runner: ModelRunner,
    kv: KVCacheManager | KVCacheCoordinator,
    max_drafts: int,
    max_tokens: int,
    max_seqs: int,
) -> CostCurve:
    """c(T) for T = 1 .. max_drafts + 1, then doubling up to ``max_tokens`` (the step
    budget, at most 256) with at most ``max_seqs`` sequences, each point the fastest of
    ``REPEATS`` rounds over all shapes; points whose KV blocks do not fit are left out
    (the curve extrapolates)."""
    width = max_drafts + 1
    shapes = [(1, t) for t in range(1, width + 1)]
    seqs = 2
    while seqs * width <= min(max_tokens, 256) and seqs <= max_seqs:
        shapes.append((seqs, width))
        seqs *= 2
    points: dict[int, float] = {}
    params = SamplingParams(temperature=0, max_tokens=1)
    _step(runner, kv, params, 1, 1)  # warm-up (first-call allocations)
    # rounds over all shapes, each point its best: a slow spell of the machine then raises
    # every shape of one round, not all the tries of one shape
    for _ in range(REPEATS):
        for num_seqs, tokens in list(shapes):
            took = _step(runner, kv, params, num_seqs, tokens)
            if took is None:  # its blocks do not fit: left out
                shapes.remove((num_seqs, tokens))
                continue
            t = num_seqs * tokens
            points[t] = min(points.get(t, took), took)
    if not points:
        return CostCurve.linear()
    curve = CostCurve.from_points(points)
    logger.info(
        "speculative decoding: verify cost t(k)/t(1) = %s",
        ", ".join(f"{k}: {curve.ratio(k):.2f}" for k in range(1, width + 1)),
    )
    return curve


def _step(
    runner: ModelRunner,
    kv: KVCacheManager | KVCacheCoordinator,
    params: SamplingParams,
    num_seqs: int,
    tokens: int,
) -> float | None:
    """Seconds of one step of ``num_seqs`` sequences with ``tokens`` new tokens each (the
    last ``tokens - 1`` as drafts); None when their blocks do not fit."""
    ids = [f"__calibrate_{i}" for i in range(num_seqs)]
    try:
        scheduled = []
        for rid in ids:
            if not kv.allocate_slots(rid, CONTEXT + tokens):
                return None
            req = Request(rid, [0] * CONTEXT, params, 1, frozenset())
            table, row = kv.table_and_row(rid)
            drafts = tuple([0] * (tokens - 1))
            scheduled.append(ScheduledSeq(req, CONTEXT - 1, tokens, table, True, row, drafts))
        sched = SchedulerOutput(tuple(scheduled), tables=kv.tables)
        start = time.perf_counter()
        runner.collect(runner.launch(sched))
        return time.perf_counter() - start
    finally:
        for rid in ids:
            kv.free(rid)
