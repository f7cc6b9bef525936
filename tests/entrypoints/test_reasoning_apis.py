"""Reasoning through the Responses and Messages APIs, on a tiny model whose template opens
``<think>``: every generated token of a short answer is reasoning, so the reasoning
parser's text must come back as a reasoning item / thinking block, streamed and not."""

from __future__ import annotations

import json

import httpx
import pytest
from _serving_helpers import MODEL, tiny_engine_llm
from chat_templates import THINKING, make_tiny_qwen2

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402


@pytest.fixture(scope="module")
def http(tmp_path_factory, smollm2_hf_tokenizer):
    path = make_tiny_qwen2(
        tmp_path_factory.mktemp("qwen-think-apis"), smollm2_hf_tokenizer, THINKING
    )
    llm = tiny_engine_llm(path, max_model_len=1024)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client
    srv.close(timeout=30)
    llm.close()


def _sse(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("summary", [None, "auto", "detailed"])
def test_responses_reasoning_item(http, summary):
    """The reasoning text is the item's content; a summary only when asked for (then the
    same text), streamed as summary or reasoning_text events accordingly."""
    body = {"model": MODEL, "input": "Why?", "max_output_tokens": 6, "temperature": 0}
    if summary is not None:
        body["reasoning"] = {"summary": summary}
    r = http.post("/v1/responses", json=body).json()
    Response.model_validate(r)
    reasoning = r["output"][0]
    assert reasoning["type"] == "reasoning"
    text = reasoning["content"][0]["text"]
    assert text and reasoning["content"][0]["type"] == "reasoning_text"
    if summary is None:
        assert reasoning["summary"] == []
    else:
        assert reasoning["summary"] == [{"type": "summary_text", "text": text}]
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = _sse(http, "/v1/responses", body)
    for e in events:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    kind = "reasoning_text" if summary is None else "reasoning_summary_text"
    deltas = "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta")
    assert deltas == text
    [done] = [e for e in events if e["type"] == f"response.{kind}.done"]
    assert done["text"] == text
    assert events[-1]["response"]["output"][0] == {**reasoning, "id": done["item_id"]}


def test_messages_thinking_block(http):
    pytest.importorskip("anthropic")
    from anthropic.types import Message

    body = {
        "model": MODEL,
        "max_tokens": 6,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Why?"}],
    }
    m = http.post("/v1/messages", json=body).json()
    Message.model_validate(m)
    assert m["content"][0]["type"] == "thinking" and m["content"][0]["thinking"]
    events = _sse(http, "/v1/messages", body)
    thinking = "".join(
        e["delta"]["thinking"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
    )
    assert thinking == m["content"][0]["thinking"]
