"""POST /v1/responses and the stored-response routes, through the official openai SDK and
raw HTTP; bodies and stream events are validated with the SDK's own pydantic types."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _serving_helpers import MODEL, tiny_engine_llm
from chat_templates import QWEN25_TOOLS, make_tiny_qwen2

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(ResponseStreamEvent)
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two digits",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
BOOL = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
SHORT = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}


def _strict(body: dict) -> Response:
    """The SDK's Response type, validated (not the lenient construct the client uses)."""
    return Response.model_validate(body, strict=False)


def _events(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for e in events:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_plain_response_with_the_sdk(client, http):
    r = client.responses.create(input="Say hi", instructions="Be brief", **SHORT)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    raw = http.post("/v1/responses", json={"input": "Say hi", **SHORT}).json()
    _strict(raw)
    assert raw["object"] == "response" and raw["store"] is True


def test_stream_event_sequence(client, http):
    events = _events(http, {"input": [{"role": "user", "content": "Hello"}], **SHORT})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    # The SDK's stream helper returns a final response on response.completed: a
    # grammar-bounded answer ends before max_output_tokens.
    fmt = {"format": {"type": "json_schema", "name": "flag", "schema": BOOL}}
    with client.responses.stream(
        input="Hello", text=fmt, model=MODEL, temperature=0, max_output_tokens=30
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert isinstance(json.loads(final.output_text)["a"], bool)


def test_store_get_input_items_delete_and_previous_response(client, http):
    first = client.responses.create(input=[{"role": "user", "content": "Remember 7"}], **SHORT)
    assert client.responses.retrieve(first.id).id == first.id
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].role == "user"
    follow = client.responses.create(input="And now?", previous_response_id=first.id, **SHORT)
    assert follow.previous_response_id == first.id
    ids = http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "And now?"}]}
    ).json()["count"]
    assert follow.usage.input_tokens > ids + first.usage.output_tokens  # the history came too
    unstored = client.responses.create(input="x", store=False, **SHORT)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    deleted = http.delete(f"/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    assert http.get(f"/v1/responses/{first.id}").status_code == 404
    r = http.post(f"/v1/responses/{follow.id}/cancel")
    assert r.status_code == 400 and "still being generated" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ],
    ids=["unknown-previous", "built-in-tool", "unknown-item", "background", "format", "role"],
)
def test_bad_requests_are_openai_errors(http, body, param):
    r = http.post("/v1/responses", json={**SHORT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"]
    assert http.post("/v1/responses", json={"input": "ok", **SHORT}).status_code == 200
    missing = http.post("/v1/responses", json={"input": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_json_schema_format(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    r = client.responses.create(
        input="A number",
        model=MODEL,
        temperature=0,
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), {**schema, "additionalProperties": False})


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, smollm2_hf_tokenizer):
    path = make_tiny_qwen2(
        tmp_path_factory.mktemp("qwen-responses"), smollm2_hf_tokenizer, QWEN25_TOOLS
    )
    llm = tiny_engine_llm(path, max_model_len=1024)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.close(timeout=30)
    llm.close()


def test_function_tools_and_their_output(qwen):
    body = {
        "model": MODEL,
        "tools": [ADD],
        "temperature": 0,
        "max_output_tokens": 120,
        "parallel_tool_calls": False,
    }
    r = qwen.responses.create(input="Add 2 and 3", tool_choice="required", **body)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "add" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    _strict(r.model_dump())
    streamed = []
    with qwen.responses.stream(input="Add 2 and 3", tool_choice="required", **body) as s:
        for event in s:
            streamed.append(event.type)
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in streamed
    assert "response.function_call_arguments.done" in streamed
    [scall] = [o for o in final.output if o.type == "function_call"]
    assert scall.arguments == call.arguments  # streamed == not streamed
    named = qwen.responses.create(
        input="Add", tool_choice={"type": "function", "name": "add"}, **body
    )
    assert [o.name for o in named.output if o.type == "function_call"] == ["add"]
    answer = qwen.responses.create(
        input=[
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "add",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ],
        previous_response_id=r.id,
        tool_choice="none",
        **body,
    )
    assert answer.output[0].type == "message"
