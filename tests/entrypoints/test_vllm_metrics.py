"""/metrics also carries vLLM's metric names (what vLLM's Grafana dashboards read), from
the same values as tokenmill's."""

from __future__ import annotations

from _serving_helpers import MODEL, chat_body
from prometheus_client.parser import text_string_to_metric_families

VLLM_SAMPLES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]


def _samples(http) -> dict[tuple[str, tuple], float]:
    text = http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_vllm_names_carry_tokenmill_values(http):
    prompt = "the same long prompt, twice, so that the second one hits the prefix cache " * 2
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200
    http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    samples = _samples(http)
    names = {name for name, _ in samples}
    for name in VLLM_SAMPLES:
        assert name in names, name
    for suffix in (
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_running",
        "kv_cache_usage_perc",
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_sum",
    ):
        assert _value(samples, "vllm:" + suffix) == _value(samples, "tokenmill:" + suffix), suffix
    assert _value(samples, "vllm:request_success_total", finished_reason="length") == _value(
        samples, "tokenmill:request_success_total", finished_reason="length"
    )
    itl = _value(samples, "vllm:inter_token_latency_seconds_count")
    assert itl == _value(samples, "vllm:time_per_output_token_seconds_count") > 0
    assert _value(samples, "vllm:generation_tokens_total") >= 11
    # the prefix cache pair counts tokens, as vLLM's: the second prompt's blocks were hits
    queries = _value(samples, "vllm:prefix_cache_queries_total")
    hits = _value(samples, "vllm:prefix_cache_hits_total")
    assert queries == _value(samples, "vllm:prompt_tokens_total") and 0 < hits < queries
    assert hits == _value(samples, "tokenmill:prefix_cache_reused_tokens_total")
