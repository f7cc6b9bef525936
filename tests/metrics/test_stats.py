"""EngineStats: histogram buckets, and the counters the engine feeds through its hooks."""

from __future__ import annotations

from tokenmill import SamplingParams
from tokenmill.metrics.stats import Histogram


def test_histogram_buckets_are_cumulative_with_inf():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [(0.1, 2), (1.0, 3), (float("inf"), 4)]
    assert h.count == 4 and h.sum == 3.65 and h.max == 3.0
    assert h.mean == 3.65 / 4


def test_engine_counts_requests_tokens_and_latencies(tiny_llm):
    stats = tiny_llm.engine.stats
    before = dict(stats.scheduling_metrics())
    prompt_tokens, generated = stats.prompt_tokens, stats.generation_tokens
    ttft, itl, e2e = (
        stats.time_to_first_token.count,
        stats.inter_token_latency.count,
        stats.e2e_latency.count,
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = tiny_llm.generate(["one prompt", "another prompt here"], params)
    after = tiny_llm.get_scheduling_metrics()
    assert after["submitted"] == before["submitted"] + 2
    assert after["completed"] == before["completed"] + 2
    assert after["queued"] == 0 and after["running"] == 0
    assert stats.prompt_tokens == prompt_tokens + sum(len(o.prompt_token_ids) for o in outs)
    assert stats.generation_tokens == generated + 10
    assert stats.time_to_first_token.count == ttft + 2
    assert stats.inter_token_latency.count == itl + 8
    assert stats.e2e_latency.count == e2e + 2
    assert stats.finished_reasons["length"] >= 2
    assert after["queue_latency_max_s"] >= after["queue_latency_avg_s"] >= 0


def test_n_counts_once_and_abort_counts_cancelled(tiny_llm):
    stats = tiny_llm.engine.stats
    submitted, completed, cancelled = stats.submitted, stats.completed, stats.cancelled
    tiny_llm.generate("fan out", SamplingParams(n=3, max_tokens=3, ignore_eos=True))
    assert (stats.submitted, stats.completed) == (submitted + 1, completed + 1)
    stream = tiny_llm.generate_stream("cancel me", SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert stats.num_running == 1
    stream.close()
    assert stats.cancelled == cancelled + 1
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_bulk_observations_equal_one_by_one() -> None:
    """A step's many inter-token gaps go in through ``observe_many`` (array ops): the same
    buckets (bounds inclusive, as bisect_left), sum, count and max as one by one."""
    import random

    from tokenmill.metrics.stats import ITL_BUCKETS, Histogram

    rng = random.Random(0)
    values = [rng.choice([0.01, 0.025, 0.3, 100.0, rng.random() * 3]) for _ in range(500)]
    one, bulk = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for v in values:
        one.observe(v)
    bulk.observe_many(values[:7])  # the short path
    bulk.observe_many(values[7:])
    assert bulk.counts == one.counts and bulk.count == one.count == 500
    assert abs(bulk.sum - one.sum) < 1e-9 and bulk.max == one.max
