"""Prometheus export of ``EngineStats``: every metric under a ``tokenmill:`` prefix, and
the ones vLLM defines also under vLLM's own ``vllm:`` names (``VLLM_NAMES``), so vLLM's
Grafana dashboards and alerts read a tokenmill server unchanged.

A ``StatsCollector`` reads the stats when scraped; nothing is counted twice.
Each server gets its own ``CollectorRegistry`` (``make_registry``), so several
servers in one process (tests) never clash in prometheus-client's global one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tokenmill.metrics.stats import EngineStats, Histogram

PREFIX = "tokenmill:"
VLLM_PREFIX = "vllm:"
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "num_preemptions": ("num_preemptions",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}
"""tokenmill name -> its vLLM names, from the same values. Older vLLM names kept as
aliases: ``gpu_cache_usage_perc`` (now ``kv_cache_usage_perc``) and
``time_per_output_token_seconds`` (the gap between two tokens, now
``inter_token_latency_seconds``). Labels as vLLM's: ``model_name``, and
``finished_reason`` on ``request_success``. The prefix-cache pair counts tokens as
vLLM's does (``_vllm_prefix_cache``), unlike tokenmill's (admissions)."""


class StatsCollector(Collector):
    """Yields the current values of an engine's stats (none while it is loading)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        kv_usage: Callable[[], float],
        model_name: str,
        prefix_cache: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self._stats = stats
        self._kv_usage = kv_usage
        self._model = model_name
        self._prefix_cache = prefix_cache

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        families = list(self._families(s))
        yield from families
        for family in families:
            name = family.name.removeprefix(PREFIX)
            for vllm_name in VLLM_NAMES.get(name, ()):
                yield _renamed(family, VLLM_PREFIX + vllm_name)
        yield from self._vllm_prefix_cache(s)

    def _vllm_prefix_cache(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's pair, in tokens: queries = the prompt tokens looked up (here: those of
        every first admission; vLLM also counts a preempted request's second lookup),
        hits = the tokens not recomputed thanks to the cache. None without the cache."""
        values = self._prefix_cache() if self._prefix_cache is not None else {}
        if "prefix_cache_reused_tokens" not in values:
            return
        for name, doc, value in (
            ("prefix_cache_queries", "Prefix cache queries, in queried tokens.", s.prompt_tokens),
            ("prefix_cache_hits", "Prefix cache hits, in cached tokens.",
             values["prefix_cache_reused_tokens"]),
        ):  # fmt: skip
            c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self._model], value)
            yield c

    def _families(self, s: EngineStats) -> Iterator[Metric]:
        yield self._gauge(
            "num_requests_running", "Sequences holding KV cache blocks.", s.num_running
        )
        yield self._gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting
        )
        yield self._gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", self._kv_usage()
        )
        yield self._counter("prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens)
        yield self._counter("generation_tokens", "Output tokens generated.", s.generation_tokens)
        yield self._counter(
            "num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions
        )
        yield self._counter("request_submitted", "Requests accepted by the engine.", s.submitted)
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Completed requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in ("stop", "length", *sorted(set(s.finished_reasons) - {"stop", "length"})):
            success.add_metric([self._model, reason], s.finished_reasons.get(reason, 0))
        yield success
        refused = CounterMetricFamily(
            PREFIX + "request_refused",
            "Requests refused: queue full (429), queue timeout or draining (503).",
            labels=["model_name", "reason"],
        )
        for reason, value in (
            ("queue_full", s.refused_queue_full),
            ("queue_timeout", s.refused_queue_timeout),
            ("draining", s.refused_draining),
        ):
            refused.add_metric([self._model, reason], value)
        yield refused
        yield self._counter(
            "request_aborted",
            "Requests cancelled before finishing (client disconnected or aborted).",
            s.cancelled,
        )
        yield self._counter("request_failed", "Requests failed by an engine error.", s.failed)
        yield from self._prefix_cache_metrics()
        yield self._histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", s.time_to_first_token
        )
        yield self._histogram(
            "inter_token_latency_seconds", "Time between two output tokens.", s.inter_token_latency
        )
        yield self._histogram(
            "e2e_request_latency_seconds", "Arrival to finish, completed requests.", s.e2e_latency
        )
        yield self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", s.queue_time
        )
        if s.spec_decode is not None:
            yield from self._spec_decode(s)

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """vLLM's spec_decode_* counters, labelled with the method; per-position accepted
        drafts as ``spec_decode_num_accepted_tokens_per_pos`` (label ``position``)."""
        spec = s.spec_decode
        assert spec is not None
        labels = ["model_name", "method"]
        for name, doc, value in (
            ("spec_decode_num_drafts", "Sequence-steps that verified drafts.", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             spec.num_accepted_tokens),
        ):  # fmt: skip
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric([self._model, spec.method], value)
            yield c
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by draft position (0 = the first draft of a step).",
            labels=[*labels, "position"],
        )
        for j, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self._model, spec.method, str(j)], value)
        yield per_pos

    def _prefix_cache_metrics(self) -> Iterator[Metric]:
        """``LLMEngine.prefix_cache_metrics()``: counters, and the cached blocks gauge."""
        values = self._prefix_cache() if self._prefix_cache is not None else {}
        for key, doc in _PREFIX_CACHE_COUNTERS.items():
            if key in values:
                yield self._counter(key, doc, values[key])
        if "recurrent_snapshot_bytes" in values:
            yield self._gauge(
                "recurrent_snapshot_bytes",
                "Bytes of the recurrent-state snapshot pool holding a snapshot.",
                values["recurrent_snapshot_bytes"],
            )
        if "prefix_cache_cached_blocks" in values:
            yield self._gauge(
                "prefix_cache_cached_blocks",
                "KV blocks holding a reusable prefix (in use or free).",
                values["prefix_cache_cached_blocks"],
            )

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        return gauge(name, doc, self._model, value)

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        return counter(name, doc, self._model, value)

    def _histogram(self, name: str, doc: str, h: Histogram) -> Metric:
        m = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in h.cumulative()]
        m.add_metric([self._model], buckets, h.sum)
        return m


def gauge(name: str, doc: str, model: str, value: float) -> Metric:
    """``tokenmill:<name>{model_name=model}`` = value."""
    g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
    g.add_metric([model], value)
    return g


def counter(name: str, doc: str, model: str, value: float) -> Metric:
    """``tokenmill:<name>_total{model_name=model}`` = value."""
    c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c


def _renamed(family: Metric, name: str) -> Metric:
    """The same family and samples under another name (suffixes such as _total kept)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [
        Sample(name + sample.name[len(family.name) :], *sample[1:]) for sample in family.samples
    ]
    return copy


_PREFIX_CACHE_COUNTERS = {
    "prefix_cache_queries": "Admissions that looked the prefix cache up.",
    "prefix_cache_hits": "Admissions that reused at least one cached block.",
    "prefix_cache_matched_tokens": "Prompt tokens whose KV blocks were found in the cache.",
    "prefix_cache_reused_tokens": "Prompt tokens not recomputed thanks to the cache.",
    "prefix_cache_evictions": "Cached blocks evicted to make room.",
    "recurrent_snapshot_restores": "Admissions of hybrid models resumed from a state snapshot.",
    "recurrent_snapshot_hit_tokens": "Prompt tokens not recomputed thanks to state snapshots.",
    "recurrent_snapshot_saves": "Recurrent-state snapshots taken.",
    "recurrent_snapshot_evictions": "Recurrent-state snapshots evicted to make room.",
}


def make_registry(
    stats: Callable[[], EngineStats | None],
    kv_usage: Callable[[], float],
    model_name: str,
    prefix_cache: Callable[[], dict[str, float]] | None = None,
) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats, kv_usage, model_name, prefix_cache))
    return registry
