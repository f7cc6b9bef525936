"""Prefix caching through the server: cached_tokens in usage, /reset_prefix_cache."""

from __future__ import annotations

from _serving_helpers import chat_body


def test_repeated_prompt_reports_cached_tokens_and_reset_clears(http):
    body = chat_body("a long enough message to fill a few KV blocks " * 4, max_tokens=2)
    first = http.post("/v1/chat/completions", json=body).json()["usage"]
    second = http.post("/v1/chat/completions", json=body).json()["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    reset = http.post("/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["reset_blocks"] > 0
    third = http.post("/v1/chat/completions", json=body).json()["usage"]
    assert third["prompt_tokens_details"]["cached_tokens"] == 0
    text = http.get("/metrics").text
    assert "tokenmill:prefix_cache_hits_total" in text
