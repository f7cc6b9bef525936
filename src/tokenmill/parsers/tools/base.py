"""The tool-call parser contract: a model's text -> (content, tool calls).

``parse(text, final)`` is a pure function of the text generated so far. With
``final=False`` it leaves out what more text could still change (a call not yet
closed, a partial marker), so each partial result is a prefix of the final one:
its ``content`` a prefix of the final content, its calls the first final calls
(the last one possibly still growing its arguments). Streaming the differences
therefore rebuilds exactly the non-streamed message.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's format)."""


@dataclass(frozen=True)
class ParsedTools:
    content: str
    """The text outside the calls, unstripped (the caller strips it)."""
    calls: tuple[ToolCall, ...] = ()


class ToolParser(ABC):
    """Parses one response. ``tools``: the request's OpenAI tool definitions."""

    name: str = ""
    template_hints: tuple[str, ...] = ()
    """Substrings of a chat template that select this parser automatically."""
    special_markers: tuple[str, ...] = ()
    """Markers that may be special tokens: the text must keep special tokens for them."""

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        self.tools = list(tools or [])
        self.tool_names = {_tool_name(t) for t in self.tools} - {None}

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedTools:
        """Content and calls of ``text``; see the module docstring for ``final``."""

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _tool_name(tool: Any) -> str | None:
    if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
        name = tool["function"].get("name")
        return name if isinstance(name, str) else None
    return None


def call_from_json(obj: Any, names: set[str] | None = None) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments"|"parameters": {...}}`` (None if not one).

    ``names``: when given, only these tool names count.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def json_values(text: str, separator: str = "") -> list[Any] | None:
    """``text`` as a sequence of JSON values (optionally separated), or None."""
    decoder = json.JSONDecoder()
    values, i, n = [], 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return values or None
        if values and separator:
            if not text.startswith(separator, i):
                return None
            i += len(separator)
            while i < n and text[i].isspace():
                i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
