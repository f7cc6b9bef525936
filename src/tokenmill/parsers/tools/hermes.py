"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json

from tokenmill.parsers.tools.base import (
    ParsedTools,
    ToolCall,
    ToolParser,
    call_from_json,
    held_back,
)


class HermesToolParser(ToolParser):
    """Any number of tagged calls anywhere in the text; the rest is content. A tagged
    block that is not a call stays in the content as it was written; an unclosed
    block at the end of the output is a call if its JSON is complete."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    template_hints = ("<tool_call>",)

    def parse(self, text: str, final: bool) -> ParsedTools:
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            open_at = text.find(self.start, pos)
            if open_at < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held_back(tail, self.start)])
                break
            content.append(text[pos:open_at])
            body_at = open_at + len(self.start)
            close_at = text.find(self.end, body_at)
            if close_at < 0:  # unclosed: decided only by the end of the output
                if final:
                    call = self._call(text[body_at:])
                    content.append("" if call else text[open_at:])
                    calls += [call] if call else []
                break
            call = self._call(text[body_at:close_at])
            if call:
                calls.append(call)
            else:
                content.append(text[open_at : close_at + len(self.end)])
            pos = close_at + len(self.end)
        return ParsedTools("".join(content), tuple(calls))

    def _call(self, body: str) -> ToolCall | None:
        try:
            return call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None
