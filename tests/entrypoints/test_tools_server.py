"""Tool calling and reasoning through the server with the official openai client, on tiny
random Qwen2 models that carry real-style chat templates. ``required`` and named tool
choices are forced by the grammar, so even random weights give valid, deterministic calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from _serving_helpers import MODEL, tiny_engine_llm
from chat_templates import QWEN25_TOOLS, THINKING, make_tiny_qwen2
from stream_check import check_every_boundary

from tokenmill.entrypoints.openai.chat_output import ChatOutputParser
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig
from tokenmill.parsers.tools import get_tool_parser
from tokenmill.parsers.tools.forced import (
    NamedToolParser,
    RequiredToolParser,
    required_schema,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
DIGITS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two digits", "parameters": DIGITS},
    },
]
SCHEMAS = {"get_weather": CITY, "add": DIGITS}
COMPACT = {**DIGITS, "x-guidance": {"whitespace_flexible": False}}  # for a raw Lark %json
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _serve(path):
    llm = tiny_engine_llm(path, max_model_len=1024)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    return llm, srv


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, smollm2_hf_tokenizer):
    openai = pytest.importorskip("openai")
    path = make_tiny_qwen2(
        tmp_path_factory.mktemp("qwen-tools"), smollm2_hf_tokenizer, QWEN25_TOOLS
    )
    llm, srv = _serve(path)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.close(timeout=30)
    llm.close()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_hf_tokenizer):
    openai = pytest.importorskip("openai")
    path = make_tiny_qwen2(tmp_path_factory.mktemp("qwen-think"), smollm2_hf_tokenizer, THINKING)
    llm, srv = _serve(path)
    yield (
        openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120),
        llm.tokenizer,
    )
    srv.close(timeout=30)
    llm.close()


def _hermes_grammar(calls: int) -> str:
    """Text, then ``calls`` Hermes calls to add (``<tool_call>`` is one added token: a
    llguidance grammar names it, it does not spell it)."""
    call = r'<tool_call> "\n{\"name\": \"add\", \"arguments\": " args "}\n" </tool_call>'
    calls_rule = r' "\n" '.join([call] * calls)
    return r'start: "Let me add them.\n" ' + calls_rule + "\nargs: %json " + json.dumps(COMPACT)


def _create(client, **kwargs):
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 120,
        "temperature": 0,
        **kwargs,
    }
    return client.chat.completions.create(**body)


def _assemble(chunks) -> dict:
    """A streamed choice 0 as the client rebuilds it."""
    msg: dict = {"content": "", "reasoning": "", "calls": [], "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            msg["content"] += delta.content or ""
            msg["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                if call.index == len(msg["calls"]):
                    assert call.id and call.type == "function"
                    msg["calls"].append([call.function.name, ""])
                msg["calls"][call.index][1] += call.function.arguments or ""
            msg["finish"] = choice.finish_reason or msg["finish"]
    return msg


def _flat(choice) -> dict:
    m = choice.message
    return {
        "content": m.content or "",
        "reasoning": (m.model_extra or {}).get("reasoning_content") or "",
        "calls": [[c.function.name, c.function.arguments] for c in m.tool_calls or []],
        "finish": choice.finish_reason,
    }


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "choice",
    [
        "required",
        {"type": "function", "function": {"name": "add"}},
        {"type": "function", "function": {"name": "get_weather"}},
    ],
)
def test_forced_tool_calls_are_valid_and_stream_the_same(qwen, choice):
    r = _create(qwen, tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    _check_calls(c.message.tool_calls)
    assert len(c.message.tool_calls) == 1
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == choice["function"]["name"]
    streamed = _assemble(_create(qwen, tool_choice=choice, parallel_tool_calls=False, stream=True))
    assert streamed == _flat(c)


def test_parallel_required_calls(qwen):
    r = _create(qwen, tool_choice="required", max_tokens=60)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        _check_calls(c.message.tool_calls)
    streamed = _assemble(_create(qwen, tool_choice="required", max_tokens=60, stream=True))
    assert streamed == _flat(c)


def test_auto_separates_text_from_calls(qwen):
    forced = _hermes_grammar(1)
    kwargs = dict(tool_choice="auto", extra_body={"structured_outputs": {"grammar": forced}})
    c = _create(qwen, **kwargs).choices[0]
    assert c.message.content == "Let me add them."
    assert c.finish_reason == "tool_calls"
    _check_calls(c.message.tool_calls)
    assert _assemble(_create(qwen, stream=True, **kwargs)) == _flat(c)
    none = _create(qwen, **{**kwargs, "tool_choice": "none"}).choices[0]  # calls stay text
    assert "<tool_call>" in none.message.content and not none.message.tool_calls


def test_real_outputs_stream_the_same_cut_anywhere(qwen):
    """Raw outputs of the model, re-chunked at every boundary, through each parser."""
    cases = [
        ({"json": required_schema(TOOLS, parallel=False)}, RequiredToolParser(TOOLS)),
        ({"json": CITY}, NamedToolParser(TOOLS, "get_weather")),
        ({"grammar": _hermes_grammar(2)}, get_tool_parser("hermes")(TOOLS)),
    ]
    for guide, parser in cases:
        text = (
            qwen.completions.create(
                model=MODEL,
                prompt="Call a tool:",
                max_tokens=120,
                temperature=0,
                extra_body={"structured_outputs": guide},
            )
            .choices[0]
            .text
        )
        output = ChatOutputParser(None, parser)
        assert output.parse(text, final=True).calls, text
        check_every_boundary(output, text)


def test_multi_turn_with_tool_results(qwen):
    first = _create(qwen, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    r = _create(qwen, messages=messages, tool_choice="required", parallel_tool_calls=False)
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10
    _check_calls(r.choices[0].message.tool_calls)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(tool_choice="required", tools=None), "tool_choice"),
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400(qwen, kwargs, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _create(qwen, **kwargs)
    assert e.value.body["param"] == param


def test_reasoning_is_split_and_only_the_answer_is_constrained(thinker):
    client, tok = thinker
    hello = tok.encode("Hello", add_special_tokens=False)[0]
    end = tok.encode("</think>", add_special_tokens=False)[0]
    # "Hello", then (its logit divided by the repetition penalty) "</think>", then the answer
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=20,
        temperature=0,
        logit_bias={str(hello): 100, str(end): 60},
        extra_body={"guided_choice": ["yes", "no"], "repetition_penalty": 10.0},
    )
    r = client.chat.completions.create(**kwargs).choices[0]
    assert r.message.model_extra["reasoning_content"] == "Hello"
    assert r.message.content in ("yes", "no") and r.finish_reason == "stop"
    streamed = _assemble(client.chat.completions.create(stream=True, **kwargs))
    assert streamed == _flat(r)


def test_thinking_off_through_chat_template_kwargs(thinker):
    client, tok = thinker
    start = tok.encode("<think>", add_special_tokens=False)[0]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=20,
        temperature=0,
        logit_bias={str(start): -100},
        extra_body={
            "guided_choice": ["yes", "no"],
            "chat_template_kwargs": {"enable_thinking": False},
        },
        reasoning_effort="low",
    ).choices[0]
    assert r.message.content in ("yes", "no")
    assert r.message.model_extra.get("reasoning_content") is None
