"""Reasoning between two markers: ``<think>...</think>`` (DeepSeek-R1, Qwen3, ...)."""

from __future__ import annotations

from tokenmill.parsers.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    held_back,
)


class ThinkReasoningParser(ReasoningParser):
    """The output may open a block with ``start`` (after optional whitespace), or the
    prompt opened it already. Text up to ``end`` is reasoning, the rest (leading
    whitespace dropped) the answer. A block that never closes is all reasoning."""

    start = "<think>"
    end = "</think>"

    def split(self, text: str, final: bool) -> ReasoningSplit:
        body = 0
        if not self.open_at_start:
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                body = len(text) - len(stripped) + len(self.start)
            elif not final and self.start.startswith(stripped):
                return ReasoningSplit(None, "")  # could still become a reasoning block
            else:
                return ReasoningSplit(None, text)
        close = text.find(self.end, body)
        if close < 0:
            stop = len(text) if final else len(text) - held_back(text[body:], self.end)
            return ReasoningSplit(text[body:stop], "")
        return ReasoningSplit(text[body:close], text[close + len(self.end) :].lstrip())


class MistralReasoningParser(ThinkReasoningParser):
    """Magistral: ``[THINK]...[/THINK]`` (special tokens: they must stay in the text)."""

    start = "[THINK]"
    end = "[/THINK]"
