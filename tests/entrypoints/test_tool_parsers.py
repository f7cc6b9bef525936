"""Tool-call and reasoning parsers: each format, and streaming == non-streaming.

The property tests cut real model outputs into chunks at every boundary (and at
random sets of boundaries) and check that the deltas ``ChatStreamer`` sends
assemble into exactly the non-streamed message.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stream_check import assemble as _assemble
from stream_check import check_every_boundary
from stream_check import full as _full

from tokenmill.entrypoints.openai.chat_output import ChatOutputParser
from tokenmill.parsers.reasoning import (
    get_reasoning_parser,
    resolve_reasoning_parser,
)
from tokenmill.parsers.tools import (
    ToolCall,
    get_tool_parser,
    resolve_tool_parser,
)
from tokenmill.parsers.tools.forced import NamedToolParser, RequiredToolParser
from tokenmill.parsers.tools.tolerant import TolerantToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    },
]
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
ADD = ToolCall("add", '{"a": 1, "b": 2}')


def parser(name: str):
    return get_tool_parser(name)(TOOLS)


@pytest.mark.parametrize(
    "name, text, content, calls",
    [
        (
            "hermes",
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris"}}\n</tool_call>',
            "Let me check.\n",
            [PARIS],
        ),
        (
            "hermes",
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
            "\n",
            [PARIS, ADD],
        ),
        (
            "hermes",
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',
            "",
            [ADD],
        ),  # unclosed
        ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        ("hermes", "no calls here", "no calls here", []),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "add", "parameters": {"a": 1, "b": 2}}',
            "",
            [PARIS, ADD],
        ),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        (
            "mistral",
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "Sure. ",
            [PARIS],
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
            "",
            [PARIS, ADD],
        ),
        ("mistral", "[TOOL_CALLS]broken", "[TOOL_CALLS]broken", []),
        ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2)]', "", [PARIS, ADD]),
        ("pythonic", "<|python_start|>[add(a=1, b=2)]<|python_end|>", "", [ADD]),
        ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
        ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
        (
            "json",
            'Calling it:\n```json\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n```\nDone.',
            "Calling it:\n\nDone.",
            [ADD],
        ),
        (
            "json",
            '{"name": "undeclared", "arguments": {}}',
            '{"name": "undeclared", "arguments": {}}',
            [],
        ),
        ("json", "Just text.", "Just text.", []),
    ],
)
def test_parsers(name, text, content, calls):
    parsed = parser(name).parse(text, final=True)
    assert parsed.content == content
    assert list(parsed.calls) == calls
    for call in parsed.calls:
        json.loads(call.arguments)


def test_forced_parsers():
    required = RequiredToolParser(TOOLS).parse(
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", '
        '"parameters": {"a": 1, "b": 2}}]',
        final=True,
    )
    assert list(required.calls) == [PARIS, ADD] and required.content == ""
    named = NamedToolParser(TOOLS, "add").parse(' {"a": 1, "b": 2}\n', final=True)
    assert list(named.calls) == [ADD]


@pytest.mark.parametrize(
    "template, expected",
    [
        ("...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>...", "hermes"),
        ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
        ("<|python_tag|>{{ ... }}", "llama3_json"),
        ("[func_name1(params_name1=params_value1)]", "pythonic"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "json"),
        (None, "json"),
    ],
)
def test_parser_chosen_from_the_chat_template(template, expected):
    chosen = resolve_tool_parser("auto", template)
    if expected == "json":
        assert chosen is get_tool_parser("json")
    else:  # the template's parser, with the JSON fallback behind it
        assert issubclass(chosen, TolerantToolParser) and chosen.name == expected
        assert chosen.primary is get_tool_parser(expected)
    assert resolve_tool_parser("pythonic", template) is get_tool_parser("pythonic")  # exact


HERMES_TEMPLATE = "...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>..."
FENCED_CALL = 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (FENCED_CALL, "Sure.\n", [PARIS]),  # the model ignored the template's tags
        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "", [ADD]),
        (
            'Text, then <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
            'Text, then \n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
            [ADD],
        ),  # tags found: the template's parser decides alone
        ('{"name": "undeclared", "arguments": {}}', '{"name": "undeclared", "arguments": {}}', []),
        ("Just text.", "Just text.", []),
    ],
)
def test_detected_parser_falls_back_to_json(text, content, calls):
    parsed = resolve_tool_parser("auto", HERMES_TEMPLATE)(TOOLS).parse(text, final=True)
    assert (parsed.content, list(parsed.calls)) == (content, calls)


def test_unknown_parser_names():
    with pytest.raises(ValueError, match="unknown"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown"):
        get_reasoning_parser("nope")


def test_reasoning_parser_selection_and_split():
    think = get_reasoning_parser("think")
    assert resolve_reasoning_parser("auto", "{{ '<think>' }}...{{ '</think>' }}") is think
    assert resolve_reasoning_parser("auto", "plain") is None
    assert resolve_reasoning_parser("none", "</think>") is None
    split = think().split("<think>\nhmm</think>\n\nThe answer.", final=True)
    assert (split.reasoning, split.content) == ("\nhmm", "The answer.")
    assert think().split("No thinking.", final=True).reasoning is None
    assert think(open_at_start=True).split("cut short", final=True).reasoning == "cut short"
    opened = think(open_at_start=True).split("a</think>b", final=True)
    assert (opened.reasoning, opened.content) == ("a", "b")


# -- streaming == non-streaming --------------------------------------------------------------
SAMPLES = [
    (
        "hermes",
        False,
        'I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Par\\u00eds"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        "</tool_call>",
    ),
    ("hermes", False, "plain <tool text with a < and a </tool_call> inside  "),
    (
        "hermes",
        True,
        '<think>\nweather? </thi\n</think>\n\n<tool_call>{"name": "add", '
        '"arguments": {"a": 1, "b": 2}}</tool_call>',
    ),
    ("llama3_json", False, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}'),
    ("mistral", False, 'ok [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'),
    ("pythonic", False, '[get_weather(city="Paris")]'),
    ("json", False, 'Sure:\n```json\n{"name": "add", "arguments": {"a": 1}}\n```\nbye `x` '),
    ("json", True, "<think>x</think>  just text  "),
    ("tolerant", False, FENCED_CALL + "\nThat is all. "),
    (
        "tolerant",
        False,
        'I will look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        "</tool_call> ```not a call``` ",
    ),
    ("tolerant", True, '<think>hm</think>{"name": "add", "arguments": {"a": 1, "b": 2}}'),
    ("tolerant", False, "`{plain} text with ``` fences and <tool_ bits"),
    (
        "required",
        False,
        ' [{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", '
        '"parameters": {"city": "Nice"}}] ',
    ),
    ("named", True, '<think>a</think>\n{"city": "Paris"}\n'),
    (None, True, "<think>reason</think>answer"),
    (None, False, " plain text, untouched "),
]


def _output_parser(name: str | None, reasoning: bool) -> ChatOutputParser:
    tools = None
    if name == "required":
        tools = RequiredToolParser(TOOLS)
    elif name == "named":
        tools = NamedToolParser(TOOLS, "get_weather")
    elif name == "tolerant":
        tools = resolve_tool_parser("auto", HERMES_TEMPLATE)(TOOLS)
    elif name is not None:
        tools = parser(name)
    return ChatOutputParser(get_reasoning_parser("think")() if reasoning else None, tools)


@pytest.mark.parametrize("name, reasoning, text", SAMPLES)
def test_stream_equals_full_at_every_boundary(name, reasoning, text):
    check_every_boundary(_output_parser(name, reasoning), text)


@settings(max_examples=60, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_stream_equals_full_for_random_chunkings(sample, cuts):
    name, reasoning, text = sample
    bounds = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    output = _output_parser(name, reasoning)
    assert _assemble(output, chunks) == _full(output, text)


def test_parallel_tool_calls_off_keeps_the_first_call():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    )
    one = ChatOutputParser(None, parser("hermes"), max_calls=1)
    assert one.parse(text, final=True).calls == (ADD,)
    check_every_boundary(one, text)
