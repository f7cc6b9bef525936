"""Models, tokenizer routes, health, metrics, version, and error objects for bad input."""

from __future__ import annotations

import pytest
from _serving_helpers import MODEL, chat_body


def test_models_version_health(client, http, server):
    [card] = client.models.list().data
    assert card.id == MODEL and card.owned_by == "tokenmill"
    assert card.model_extra["max_model_len"] == 256
    assert http.get("/version").json()["version"]
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > r["count"]
    assert http.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400


def test_metrics_are_prometheus_text(http):
    http.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total",
        "tokenmill:request_success_total",
        "tokenmill:request_refused_total",
        "tokenmill:request_aborted_total",
        "tokenmill:time_to_first_token_seconds_bucket",
        "tokenmill:inter_token_latency_seconds_bucket",
        "tokenmill:e2e_request_latency_seconds_count",
        "tokenmill:request_queue_time_seconds_sum",
        "tokenmill:prefix_cache_queries_total",
        "tokenmill:prefix_cache_hits_total",
        "tokenmill:prefix_cache_cached_blocks",
    ):
        assert name in text, name
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    generated = families["tokenmill:generation_tokens"].samples[0].value
    assert generated >= 3


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"{",
        b"[]",
        b"null",
        b"42",
        b'"text"',
        b"{}",
        b'{"messages": "hi"}',
        b'{"messages": [{"content": "no role"}]}',
        b'{"messages": []}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}',
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
        b'{"messages": [{"role": "user", "content": "x"}], "n": 1.5}',
        b'{"messages": [{"role": "user", "content": "x"}], "n": 0}',
        b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}',
        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}',
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}',
        b'{"messages": [{"role": "user", "content": "x"}], "guided_regex": "(unclosed"}',
        b'{"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a"], "guided_regex": "a"}',
        b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}',
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}',
        b"\xff\xfe garbage bytes",
    ],
)
def test_garbage_bodies_get_400(http, body):
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, (body, r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_wrong_content_type_gets_400(http):
    r = http.post(
        "/v1/completions",
        content=b"prompt=hi",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400


def test_unknown_model_404_and_route_404(client, http):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_context_length_400(client, http):
    import openai

    long_prompt = "word " * 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    assert "max_model_len" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model=MODEL, max_tokens=1000, messages=[{"role": "user", "content": "x"}]
        )


def test_server_keeps_serving_after_errors(http):
    for _ in range(3):
        assert http.post("/v1/chat/completions", content=b"{").status_code == 400
        assert http.post("/v1/completions", json={"prompt": [10**7]}).status_code == 400
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_n_above_the_limit_names_the_field(http):
    for route, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        r = http.post(route, json={**body, "model": MODEL, "n": 129, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
