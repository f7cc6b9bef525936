"""Pythonic tool calls (Llama 3.2 / 4 style): ``[get_weather(city="Paris"), now()]``."""

from __future__ import annotations

import ast
import json

from tokenmill.parsers.tools.base import ParsedTools, ToolCall, ToolParser


class PythonicToolParser(ToolParser):
    """The whole answer is one Python list of calls with literal keyword arguments
    (optionally inside ``<|python_start|>`` ... ``<|python_end|>``), or it is content."""

    name = "pythonic"
    start_tag = "<|python_start|>"
    end_tag = "<|python_end|>"
    template_hints = ("[func_name1(", "<|python_start|>")
    special_markers = ("<|python_start|>", "<|python_end|>")

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.strip()
        looks_like_calls = body.startswith(("[", self.start_tag)) or self.start_tag.startswith(body)
        if not looks_like_calls:
            return ParsedTools(text)
        if not final:
            return ParsedTools("")
        body = body.removeprefix(self.start_tag).removesuffix(self.end_tag).strip()
        calls = _calls(body)
        return ParsedTools("", calls) if calls else ParsedTools(text)


def _calls(source: str) -> tuple[ToolCall, ...] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return tuple(calls)
