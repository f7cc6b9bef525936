"""A chat choice's text -> reasoning, content and tool calls; and the same as stream deltas.

``ChatOutputParser.parse(text, final)`` runs the reasoning parser, then the tool
parser on the answer. Both return, for a partial text, a prefix of what the final
text gives (see their base modules), so ``ChatStreamer`` can send differences
and the client's assembly equals the non-streamed message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenmill.parsers.reasoning import ReasoningParser
from tokenmill.parsers.tools import ToolCall, ToolParser

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatParts:
    reasoning: str | None
    content: str
    calls: tuple[ToolCall, ...] = ()


class ChatOutputParser:
    """Per choice. ``reasoning``/``tools`` None: that part is not parsed."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        max_calls: int | None = None,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        """Calls past this many are dropped (``parallel_tool_calls=false``: 1)."""

    @property
    def is_plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def parse(self, text: str, final: bool) -> ChatParts:
        reasoning = None
        if self.reasoning is not None:
            split = self.reasoning.split(text, final)
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return ChatParts(reasoning, text)
        parsed = self.tools.parse(text, final)
        # Stripped; a partial strip is a prefix of the final one (rstrip holds back spaces).
        return ChatParts(reasoning, parsed.content.strip(), parsed.calls[: self.max_calls])


@dataclass
class DeltaParts:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)
    """OpenAI tool-call deltas: {"index", "id", "type", "function": {"name", "arguments"}}
    for a new call, {"index", "function": {"arguments"}} for more of its arguments."""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class _SentCall:
    id: str
    arguments: int = 0


class ChatStreamer:
    """Turns a choice's growing text into deltas of reasoning, content and tool calls."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.parser = parser
        self.text = ""
        self._reasoning = 0
        self._content = 0
        self._calls: list[_SentCall] = []

    def feed(self, new_text: str, final: bool) -> DeltaParts:
        self.text += new_text
        if self.parser.is_plain:
            return DeltaParts(content=new_text)
        parts = self.parser.parse(self.text, final)
        delta = DeltaParts(
            reasoning=self._tail(parts.reasoning or "", "_reasoning"),
            content=self._tail(parts.content, "_content"),
        )
        for i, call in enumerate(parts.calls):
            if i == len(self._calls):
                sent = _SentCall(self.parser.tools.new_call_id())  # type: ignore[union-attr]
                self._calls.append(sent)
                delta.calls.append(
                    {
                        "index": i,
                        "id": sent.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
            else:
                sent = self._calls[i]
                more = call.arguments[sent.arguments :]
                if more:
                    delta.calls.append({"index": i, "function": {"arguments": more}})
            sent.arguments = len(call.arguments)
        return delta

    @property
    def call_ids(self) -> list[str]:
        return [c.id for c in self._calls]

    def _tail(self, value: str, attr: str) -> str:
        sent = getattr(self, attr)
        if len(value) < sent:
            logger.warning(
                "chat output parser went back on %s (%d < %d chars)", attr, len(value), sent
            )
            return ""
        setattr(self, attr, len(value))
        return value[sent:]
