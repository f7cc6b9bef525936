"""A template's own parser, then the tolerant JSON fallback when the model ignored the format.

Models often answer a tool request with a bare or fenced JSON call even though their
template teaches tags (Qwen2.5-Coder writes a ```json fence instead of ``<tool_call>``).
With ``--tool-call-parser auto`` the detected parser is wrapped in this: its calls win;
without any, the answer is read by the ``json`` fallback.

Streaming keeps the prefix contract of ``base``: while the output is open, the content
is only what *both* parsers already consider settled text (their common prefix), so
whichever of the two decides the final message, every partial content is a prefix of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenmill.parsers.tools.base import ParsedTools, ToolParser
from tokenmill.parsers.tools.json_fallback import JsonToolParser


class TolerantToolParser(ToolParser):
    """Subclassed per primary parser by ``tolerant``; not used directly."""

    primary: type[ToolParser]

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        super().__init__(tools)
        self._primary = self.primary(tools)
        self._fallback = JsonToolParser(tools)

    def parse(self, text: str, final: bool) -> ParsedTools:
        first = self._primary.parse(text, final)
        if first.calls:
            return first
        second = self._fallback.parse(text, final)
        if final:
            return second if second.calls else first
        return ParsedTools(os.path.commonprefix([first.content, second.content]))


def tolerant(primary: type[ToolParser]) -> type[ToolParser]:
    """``primary`` with the JSON fallback behind it (same name, hints and markers)."""
    return type(
        f"Tolerant{primary.__name__}",
        (TolerantToolParser,),
        {
            "primary": primary,
            "name": primary.name,
            "template_hints": primary.template_hints,
            "special_markers": primary.special_markers,
        },
    )
