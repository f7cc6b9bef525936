"""Reasoning parsers by name (lazy imports), and the choice of one for a chat template.

``--reasoning-parser NAME`` (``EngineConfig.reasoning_parser``) picks one; ``auto``
looks for a parser's markers in the chat template; ``none`` turns reasoning off.
"""

from __future__ import annotations

import importlib

from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.reasoning.base import ReasoningParser, ReasoningSplit

_THINK = "tokenmill.parsers.reasoning.think"
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "think": (_THINK, "ThinkReasoningParser"),
    "deepseek_r1": (_THINK, "ThinkReasoningParser"),
    "qwen3": (_THINK, "ThinkReasoningParser"),
    "mistral": (_THINK, "MistralReasoningParser"),
}
"""Name -> (module, class)."""

_TEMPLATE_HINTS = (("</think>", "think"), ("[/THINK]", "mistral"))
"""A chat template containing the marker -> the parser ``auto`` picks."""

__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningSplit",
    "get_reasoning_parser",
    "resolve_reasoning_parser",
]


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise InvalidRequestError(
            f"reasoning parser {name!r} is unknown; use auto, none or one of "
            f"{', '.join(REASONING_PARSERS)}"
        )
    module, cls = REASONING_PARSERS[name]
    return getattr(importlib.import_module(module), cls)


def resolve_reasoning_parser(
    name: str | None, chat_template: str | None
) -> type[ReasoningParser] | None:
    """The parser for ``name``: auto detects it from the chat template; none/None: off."""
    if name in (None, "", "none"):
        return None
    if name == "auto":
        for marker, found in _TEMPLATE_HINTS:
            if chat_template and marker in chat_template:
                return get_reasoning_parser(found)
        return None
    return get_reasoning_parser(name)
