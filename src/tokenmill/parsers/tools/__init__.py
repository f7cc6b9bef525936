"""Tool-call parsers by name (lazy imports), and the choice of one for a chat template.

``--tool-call-parser NAME`` picks one; ``auto`` (the default) looks for a parser's
markers in the model's chat template, and reads an answer without the template's calls
with ``json`` (a bare or fenced JSON call naming a declared tool; see ``tolerant``).
"""

from __future__ import annotations

import importlib

from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.tools.base import ParsedTools, ToolCall, ToolParser

_PKG = "tokenmill.parsers.tools"
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": (f"{_PKG}.hermes", "HermesToolParser"),
    "qwen": (f"{_PKG}.hermes", "HermesToolParser"),
    "llama3_json": (f"{_PKG}.llama3", "Llama3JsonToolParser"),
    "mistral": (f"{_PKG}.mistral", "MistralToolParser"),
    "pythonic": (f"{_PKG}.pythonic", "PythonicToolParser"),
    "json": (f"{_PKG}.json_fallback", "JsonToolParser"),
}
"""Name -> (module, class)."""

_DETECTION_ORDER = ("hermes", "mistral", "pythonic", "llama3_json")
"""The first parser whose template hints occur in the chat template wins."""
FALLBACK = "json"

__all__ = [
    "TOOL_PARSERS",
    "ParsedTools",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
    "resolve_tool_parser",
]


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(
            f"tool-call parser {name!r} is unknown; use auto or one of {', '.join(TOOL_PARSERS)}"
        )
    module, cls = TOOL_PARSERS[name]
    return getattr(importlib.import_module(module), cls)


def resolve_tool_parser(name: str | None, chat_template: str | None) -> type[ToolParser]:
    """The parser called ``name``; auto/None: the one detected from the chat template, with
    the JSON fallback behind it, or the JSON fallback alone."""
    if name not in (None, "", "auto"):
        return get_tool_parser(name)  # type: ignore[arg-type]
    from tokenmill.parsers.tools.tolerant import tolerant

    for candidate in _DETECTION_ORDER:
        parser = get_tool_parser(candidate)
        if chat_template and any(h in chat_template for h in parser.template_hints):
            return tolerant(parser)
    return get_tool_parser(FALLBACK)
