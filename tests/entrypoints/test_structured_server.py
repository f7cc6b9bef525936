"""Structured output through the server (the tiny random Llama): response_format,
vLLM's structured_outputs and guided_* fields, chat and completions, streamed or not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from _serving_helpers import MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Answer as JSON."}]


def _chat(client, **kwargs):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, **kwargs}
    return client.chat.completions.create(**body)


def test_response_format_json_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    c = _chat(client, response_format=fmt).choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    chunks = _chat(client, response_format=fmt, stream=True)
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        == c.message.content
    )


def test_response_format_json_object(client):
    c = _chat(
        client, response_format={"type": "json_object"}, max_tokens=40, temperature=1.0, seed=1
    ).choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.finish_reason == "length" and c.message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
        (
            {"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}},
            lambda t: t in ("xy", "xz"),
        ),
    ],
)
def test_vllm_fields_on_chat_and_completions(client, extra, check):
    chat = _chat(client, extra_body=extra).choices[0]
    assert chat.finish_reason == "stop" and check(chat.message.content)
    text = client.completions.create(
        model=MODEL, prompt="Say it:", max_tokens=60, temperature=0, extra_body=extra
    ).choices[0]
    assert text.finish_reason == "stop" and check(text.text)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": 7}}}}, "JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "twice"),
        ({"structured_outputs": {"choice": "ab"}}, "list of strings"),
    ],
)
def test_bad_guides_are_400_naming_the_problem(client, extra, words):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra_body=extra)
    assert words in e.value.body["message"]
