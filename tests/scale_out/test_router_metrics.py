"""The router's /metrics families: router totals and one sample per replica."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.distributed.router_metrics import RouterCollector


def test_router_families_and_replica_samples():
    front = SimpleNamespace(
        router_stats=SimpleNamespace(hit_rate=0.25, retried=3, restarts=1),
        replica_report=lambda: [
            {"router_requests": 5, "replica_up": 1},
            {"router_requests": 2, "replica_up": 0},
        ],  # fmt: skip
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(lambda: front, "m"))
    samples = {
        (s.name, s.labels.get("replica")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("tokenmill:router_expected_hit_rate", None)] == 0.25
    assert samples[("tokenmill:router_retried_total", None)] == 3
    assert samples[("tokenmill:router_restarts_total", None)] == 1
    assert samples[("tokenmill:router_requests_total", "0")] == 5
    assert samples[("tokenmill:replica_up", "1")] == 0
    assert samples[("tokenmill:replica_prompt_tokens_total", "1")] == 0  # absent: 0


def test_no_router_no_families():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(lambda: None, "m"))
    assert "tokenmill:" not in generate_latest(registry).decode()
