"""``/metrics`` of a data-parallel server: the router's choices and each replica's counters.

The server's own collector already shows the totals (``DataParallelRouter.stats`` sums
the replicas); this one adds, labelled by ``replica``: requests routed, whether it is up,
its running sequences, prompt / generated tokens and prefix-cache reuse; and the
router's expected hit rate, retries and restarts. Nothing is yielded for a server
without replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.metrics.prometheus import PREFIX, counter, gauge


class RouterCollector(Collector):
    def __init__(self, front: Callable[[], Any], model_name: str) -> None:
        self._front = front
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        front = self._front()
        report = getattr(front, "replica_report", None)
        if report is None:
            return
        stats, replicas = front.router_stats, report()
        yield self._gauge("router_expected_hit_rate", "Prompt tokens the router expected "
                          "the chosen replica to hold, over prompt tokens routed.", stats.hit_rate)  # fmt: skip
        yield self._counter("router_retried", "Requests re-sent after their replica died "
                            "before any output.", stats.retried)  # fmt: skip
        yield self._counter("router_restarts", "Replicas restarted.", stats.restarts)
        per_replica = {
            "router_requests": (CounterMetricFamily, "Requests routed to the replica."),
            "replica_up": (GaugeMetricFamily, "1 while the replica serves."),
            "replica_num_requests_running": (GaugeMetricFamily, "Sequences holding KV blocks."),
            "replica_prompt_tokens": (CounterMetricFamily, "Prompt tokens prefilled."),
            "replica_generation_tokens": (CounterMetricFamily, "Output tokens sampled."),
            "replica_prefix_cache_reused_tokens": (
                CounterMetricFamily, "Prompt tokens not recomputed thanks to the cache.",
            ),
        }  # fmt: skip
        for name, (family_cls, doc) in per_replica.items():
            family = family_cls(PREFIX + name, doc, labels=["model_name", "replica"])
            for i, values in enumerate(replicas):
                family.add_metric([self._model, str(i)], values.get(name, 0))
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        return gauge(name, doc, self._model, value)

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        return counter(name, doc, self._model, value)
