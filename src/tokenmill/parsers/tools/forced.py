"""``tool_choice`` required / named: the grammar forces the call, these read it back.

``required``: the answer is a JSON list of ``{"name": <a declared tool>, "parameters":
{...}}`` (at least one; exactly one without ``parallel_tool_calls``), each valid
under its tool's schema. A named function: the answer is the arguments object.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tokenmill.parsers.tools.base import (
    ParsedTools,
    ToolCall,
    ToolParser,
    call_from_json,
)
from tokenmill.structured_output.params import StructuredOutputsParams


def parameters_schema(tool: dict) -> dict:
    schema = tool["function"].get("parameters")
    return schema if isinstance(schema, dict) else {"type": "object", "properties": {}}


def required_schema(tools: Sequence[dict], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls to the declared tools."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_guide(
    tools: Sequence[dict], choice: str | dict, parallel: bool
) -> StructuredOutputsParams:
    """The grammar for ``tool_choice`` required or ``{"type": "function", "function":
    {"name": ...}}`` (already checked against the declared tools)."""
    if choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel))
    name = choice["function"]["name"]  # type: ignore[index]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return StructuredOutputsParams(json=parameters_schema(tool))


class RequiredToolParser(ToolParser):
    """Reads the JSON list of calls; each complete item is a call at once."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedTools:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        i = _skip(text, 0)
        if not text.startswith("[", i):
            return ParsedTools(text if final else "")
        i += 1
        while True:
            i = _skip(text, i)
            if text.startswith(",", i):
                i = _skip(text, i + 1)
            try:
                item, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                break
            call = call_from_json(item)
            if call is None:
                break
            calls.append(call)
        return ParsedTools("", tuple(calls))


class NamedToolParser(ToolParser):
    """The whole answer is the arguments of the named function; they stream as they come."""

    name = "named"

    def __init__(self, tools: Sequence[dict] | None, function: str) -> None:
        super().__init__(tools)
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedTools:
        args = text.strip() if final else text.lstrip()
        if not final:
            args = args.rstrip()
        return ParsedTools("", (ToolCall(self.function, args),))


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
