"""Request fields -> guide and tool setup (entrypoints/openai/structured.py), no server."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.structured import (
    guide_of,
    template_kwargs,
    tool_setup,
    with_tool_arguments,
)
from tokenmill.parsers.tools.forced import NamedToolParser, RequiredToolParser
from tokenmill.structured_output import StructuredOutputsParams as Guide

MSG = [{"role": "user", "content": "x"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSG, **fields)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Guide(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "object"}},
                }
            },
            Guide(json={"type": "object"}),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "strict": True, "schema": {"type": "object"}},
                }
            },
            Guide(json={"type": "object"}, disable_additional_properties=True),
        ),
        ({"structured_outputs": {"regex": "a+"}}, Guide(regex="a+")),
        ({"structured_outputs": {}}, None),
        ({"guided_choice": ["a", "b"]}, Guide(choice=["a", "b"])),
        (
            {"guided_json": {"type": "integer"}, "guided_whitespace_pattern": " ?"},
            Guide(json={"type": "integer"}, whitespace_pattern=" ?"),
        ),
        (
            {"response_format": {"type": "structural_tag", "triggers": ["<f"], "structures": []}},
            Guide(structural_tag={"triggers": ["<f"], "structures": []}),
        ),
    ],
)
def test_guide_of(fields, expected):
    assert guide_of(chat(**fields)) == expected
    assert guide_of(CompletionRequest(prompt="p", **fields)) == expected


def test_tool_setups():
    assert tool_setup(chat(), None, None).parser is None
    assert tool_setup(chat(tools=[TOOL], tool_choice="none"), None, None).parser is None
    auto = tool_setup(chat(tools=[TOOL]), "auto", "<tool_call>")
    assert auto.parser.name == "hermes" and auto.guide is None  # (with the JSON fallback)
    required = tool_setup(
        chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False), None, None
    )
    assert isinstance(required.parser, RequiredToolParser)
    schema = required.guide.json
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["f"]
    named = tool_setup(
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}}), None, None
    )
    assert isinstance(named.parser, NamedToolParser)
    assert named.guide == Guide(json=TOOL["function"]["parameters"])


def test_bad_fields_are_api_errors():
    with pytest.raises(APIError, match="twice"):
        guide_of(chat(guided_regex="a", response_format={"type": "json_object"}))
    with pytest.raises(APIError, match="needs tools"):
        tool_setup(chat(tool_choice="required"), None, None)


def test_message_helpers():
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }
    assert with_tool_arguments(message)["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated
    with pytest.raises(APIError, match="not JSON"):
        with_tool_arguments({**message, "tool_calls": [{"function": {"arguments": "{"}}]})
    kwargs = template_kwargs(
        chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    )
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
