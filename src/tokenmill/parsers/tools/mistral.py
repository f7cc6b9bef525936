"""Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3 tokenizers),
or ``[TOOL_CALLS]name[ARGS]{...}`` repeated (v11+). Content is the text before it."""

from __future__ import annotations

import json
import random
import string

from tokenmill.parsers.tools.base import (
    ParsedTools,
    ToolCall,
    ToolParser,
    call_from_json,
    held_back,
    json_values,
)

_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    template_hints = ("[TOOL_CALLS]",)
    special_markers = ("[TOOL_CALLS]", "[ARGS]")

    def parse(self, text: str, final: bool) -> ParsedTools:
        at = text.find(self.marker)
        if at < 0:
            return ParsedTools(text if final else text[: len(text) - held_back(text, self.marker)])
        if not final:
            return ParsedTools(text[:at])
        calls = self._calls(text[at:])
        return ParsedTools(text[:at], calls) if calls else ParsedTools(text)

    def _calls(self, tail: str) -> tuple[ToolCall, ...] | None:
        parts = [p for p in tail.split(self.marker) if p.strip()]
        calls: list[ToolCall | None] = []
        for part in parts:
            if self.args_marker in part:  # name[ARGS]{...}
                name, _, args = part.partition(self.args_marker)
                try:
                    calls.append(
                        call_from_json({"name": name.strip(), "arguments": json.loads(args)})
                    )
                except json.JSONDecodeError:
                    return None
            else:  # [{"name": ..., "arguments": ...}, ...]
                values = json_values(part)
                items = values[0] if values and len(values) == 1 else None
                items = [items] if isinstance(items, dict) else items
                if not isinstance(items, list):
                    return None
                calls += [call_from_json(v) for v in items]
        if not calls or None in calls:
            return None
        return tuple(calls)  # type: ignore[arg-type]

    def new_call_id(self) -> str:
        """Mistral's templates insist on 9 alphanumeric characters."""
        return "".join(random.choices(_ID_CHARS, k=9))
