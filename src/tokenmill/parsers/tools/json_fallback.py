"""The tolerant fallback: a bare JSON call, or one in a ``` fence, naming a declared tool.

``{"name": "get_weather", "arguments": {...}}`` (or ``"parameters"``), or a list of
them, as the whole answer or inside the first fenced block (the text around the
fence is content). Anything else is content.
"""

from __future__ import annotations

import re

from tokenmill.parsers.tools.base import (
    ParsedTools,
    ToolCall,
    ToolParser,
    call_from_json,
    held_back,
    json_values,
)

_FENCE = "```"
_FENCED = re.compile(r"```[a-zA-Z]*\s*\n?(.*?)```", re.DOTALL)


class JsonToolParser(ToolParser):
    name = "json"

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        if body[:1] in ("", "{", "["):  # maybe the whole answer is the calls
            if not final:
                return ParsedTools("")
            calls = self._calls(body)
            return ParsedTools("", calls) if calls else ParsedTools(text)
        fence = text.find(_FENCE)
        if fence < 0:
            return ParsedTools(text if final else text[: len(text) - held_back(text, _FENCE)])
        if not final:
            return ParsedTools(text[:fence])
        match = _FENCED.search(text, fence)
        calls = self._calls(match.group(1)) if match and match.start() == fence else None
        if not calls:
            return ParsedTools(text)
        return ParsedTools(text[:fence] + text[match.end() :], calls)  # type: ignore[union-attr]

    def _calls(self, source: str) -> tuple[ToolCall, ...] | None:
        values = json_values(source)
        if not values or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [call_from_json(v, self.tool_names) for v in items]
        if not calls or None in calls:
            return None
        return tuple(calls)  # type: ignore[arg-type]
