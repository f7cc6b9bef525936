"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}`` (``; ``-separated),
optionally after ``<|python_tag|>``. The whole answer is the calls, or none of it is."""

from __future__ import annotations

from tokenmill.parsers.tools.base import (
    ParsedTools,
    ToolParser,
    call_from_json,
    json_values,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    template_hints = ("<|python_tag|>", '"parameters": ')
    special_markers = ("<|python_tag|>",)

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        looks_like_calls = body.startswith(("{", self.tag)) or self.tag.startswith(body)
        if not looks_like_calls:
            return ParsedTools(text)
        if not final:  # calls are decided by the whole answer
            return ParsedTools("")
        body = body.removeprefix(self.tag)
        values = json_values(body, ";")
        calls = [call_from_json(v) for v in values or []]
        if not calls or None in calls:
            return ParsedTools(text)
        return ParsedTools("", tuple(calls))  # type: ignore[arg-type]
