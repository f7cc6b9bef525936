"""Real responses of the server, validated field for field against OpenAI's response schema
(see openai_schema.py): plain answers, logprobs, n > 1, streams, tool calls and errors."""

from __future__ import annotations

import pytest
from _serving_helpers import MODEL, chat_body, tiny_engine_llm
from chat_templates import QWEN25_TOOLS, make_tiny_qwen2
from openai_schema import check, sse_events

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
            },
        },
    }
]


def _stream(http, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.iter_lines())


def _completion(**fields) -> dict:
    return {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
        **fields,
    }


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"logprobs": True, "top_logprobs": 2},
        {"n": 3, "temperature": 1.0, "seed": 1},
        {"service_tier": "auto", "max_completion_tokens": 3},
        {"stop": ["the"]},
    ],
    ids=["plain", "logprobs", "n3", "tier", "stop"],
)
def test_chat_completion_matches_the_schema(http, fields):
    body = check(
        "chat.completion", http.post("/v1/chat/completions", json=chat_body(**fields)).json()
    )
    message = body["choices"][0]["message"]
    assert message["refusal"] is None and "tool_calls" not in message
    assert len(body["choices"]) == fields.get("n", 1)
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    if "service_tier" in fields:
        assert body["service_tier"] == "default"
    if "logprobs" in fields:
        assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    else:
        assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"logprobs": True, "top_logprobs": 1},
        {"n": 2, "temperature": 1.0, "seed": 3},
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ],
    ids=["plain", "logprobs", "n2", "usage", "continuous"],
)
def test_chat_stream_chunks_match_the_schema(http, fields):
    chunks = _stream(http, "/v1/chat/completions", chat_body(**fields))
    for chunk in chunks:
        check("chat.completion.chunk", chunk)
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert len(finishes) == fields.get("n", 1)
    if fields.get("stream_options"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"logprobs": 2},
        {"n": 2, "temperature": 1.0, "seed": 2},
        {"prompt": ["a b", "c d"]},
        {"echo": True},
    ],
    ids=["plain", "logprobs", "n2", "batch", "echo"],
)
def test_completion_matches_the_schema(http, fields):
    body = check("text_completion", http.post("/v1/completions", json=_completion(**fields)).json())
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    chunks = _stream(
        http, "/v1/completions", _completion(**fields, stream_options={"include_usage": True})
    )
    for chunk in chunks:
        check("text_completion.chunk", chunk)
    assert chunks[-1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]


@pytest.mark.parametrize(
    "route,body,status,param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, 400, "model"),
        ("/v1/completions", {"prompt": "Hi"}, 400, "model"),
        ("/v1/chat/completions", {**chat_body(), "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {**chat_body(), "max_tokens": 10**6}, 400, "messages"),
        ("/v1/chat/completions", {**chat_body(), "temperature": -1}, 400, None),
        ("/v1/completions", {**_completion(), "n": "x"}, 400, "n"),
    ],
    ids=[
        "chat-no-model",
        "completion-no-model",
        "unknown-model",
        "no-messages",
        "too-long",
        "bad-temperature",
        "bad-type",
    ],
)
def test_errors_match_the_schema(http, route, body, status, param):
    r = http.post(route, json=body)
    assert r.status_code == status
    error = check("error", r.json())["error"]
    assert error["param"] == param
    if param == "model":
        assert repr(MODEL) in error["message"]  # names the served ids


def test_models_and_unknown_routes_match_the_schema(http):
    for card in http.get("/v1/models").json()["data"]:
        check("model", card)
    r = http.get("/v1/nope")
    assert r.status_code == 404
    check("error", r.json())


@pytest.fixture(scope="module")
def qwen_http(tmp_path_factory, smollm2_hf_tokenizer):
    import httpx

    path = make_tiny_qwen2(
        tmp_path_factory.mktemp("qwen-schema"), smollm2_hf_tokenizer, QWEN25_TOOLS
    )
    llm = tiny_engine_llm(path, max_model_len=1024)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http
    srv.close(timeout=30)
    llm.close()


def test_tool_calls_match_the_schema(qwen_http):
    body = chat_body(
        "Add 2", tools=TOOLS, tool_choice="required", max_tokens=40, parallel_tool_calls=False
    )
    full = check("chat.completion", qwen_http.post("/v1/chat/completions", json=body).json())
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert "content" in choice["message"] and choice["message"]["refusal"] is None
    chunks = _stream(qwen_http, "/v1/chat/completions", body)
    for chunk in chunks:
        check("chat.completion.chunk", chunk)
    calls = [t for ch in chunks for c in ch["choices"] for t in c["delta"].get("tool_calls", [])]
    assert calls and calls[0]["id"] and calls[0]["function"]["name"] == "add"
    # A plain answer on a tools-capable template carries no tool_calls key at all.
    plain = check(
        "chat.completion",
        qwen_http.post(
            "/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice="none")
        ).json(),
    )
    assert "tool_calls" not in plain["choices"][0]["message"]
