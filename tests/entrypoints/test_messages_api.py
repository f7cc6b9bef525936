"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic SDK:
plain, streamed, tools (forced by the grammar, so random weights give valid calls), and
Anthropic error bodies; auth by x-api-key as well as Bearer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from _serving_helpers import MODEL, tiny_engine_llm
from chat_templates import QWEN25_TOOLS, make_tiny_qwen2

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

anthropic = pytest.importorskip("anthropic")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(RawMessageStreamEvent)
ADD = {
    "name": "add",
    "description": "Add two digits",
    "input_schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
    },
}
HI = [{"role": "user", "content": "Hi"}]
KEY = "sekret"
GREEDY = {"temperature": 0}
"""This anthropic SDK has no temperature argument; the API (and this server) still take it."""


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, smollm2_hf_tokenizer):
    path = make_tiny_qwen2(
        tmp_path_factory.mktemp("qwen-messages"), smollm2_hf_tokenizer, QWEN25_TOOLS
    )
    llm = tiny_engine_llm(path, max_model_len=1024)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning", api_key=KEY)).start()
    yield srv
    srv.close(timeout=30)
    llm.close()


@pytest.fixture(scope="module")
def client(qwen):
    return anthropic.Anthropic(base_url=qwen.url, api_key=KEY, max_retries=0, timeout=120)


def test_plain_message(client, qwen):
    m = client.messages.create(
        model=MODEL, max_tokens=5, messages=HI, system="Be brief", extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.usage.output_tokens == 5
    Message.model_validate(m.model_dump())
    with httpx.Client(
        base_url=qwen.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    ) as http:  # Bearer works too
        r = http.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 3, "messages": HI, "stop_sequences": ["\n"]},
        )
        assert r.status_code == 200
        Message.model_validate(r.json())
    count = client.messages.count_tokens(model=MODEL, messages=HI, system="Be brief")
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stream_events(client, qwen):
    with httpx.Client(base_url=qwen.url, timeout=60, headers={"x-api-key": KEY}) as http:
        with http.stream(
            "POST",
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 6,
                "messages": HI,
                "temperature": 0,
                "stream": True,
            },
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENT.validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    with client.messages.stream(model=MODEL, max_tokens=6, messages=HI, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    streamed = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == streamed == final.content[0].text


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
def test_tools(client, choice):
    body = {
        "model": MODEL,
        "max_tokens": 120,
        "extra_body": GREEDY,
        "tools": [ADD],
        "tool_choice": {**choice, "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "Add 2 and 3"}],
    }
    m = client.messages.create(**body)
    assert m.stop_reason == "tool_use"
    [use] = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "add" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, ADD["input_schema"])
    with client.messages.stream(**body) as s:
        final = s.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and final.stop_reason == "tool_use"
    answer = client.messages.create(
        **{
            **body,
            "tool_choice": {"type": "none"},
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": [use.model_dump()]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
                },
            ],
        }
    )
    assert answer.content[0].type == "text"


@pytest.mark.parametrize(
    "body,status,kind",
    [
        ({"model": MODEL, "messages": HI}, 400, "invalid_request_error"),  # no max_tokens
        ({"max_tokens": 5, "messages": HI}, 400, "invalid_request_error"),  # no model
        ({"model": "claude-x", "max_tokens": 5, "messages": HI}, 404, "not_found_error"),
        (
            {
                "model": MODEL,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
    ],
    ids=["no-max-tokens", "no-model", "unknown-model", "image", "bad-role"],
)
def test_errors_are_anthropic_bodies(qwen, body, status, kind):
    with httpx.Client(base_url=qwen.url, timeout=60, headers={"x-api-key": KEY}) as http:
        r = http.post("/v1/messages", json=body)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
        if "max_tokens" not in body:
            assert "max_tokens" in r.json()["error"]["message"]
        assert (
            http.post(
                "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HI}
            ).status_code
            == 200
        )


def test_wrong_key_is_an_anthropic_401(qwen):
    bad = anthropic.Anthropic(base_url=qwen.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=2, messages=HI)
    assert err.value.body["error"]["type"] == "authentication_error"
