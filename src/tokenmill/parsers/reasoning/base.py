"""The reasoning parser contract: split a model's text into reasoning and answer.

``split(text, final)`` is a pure function of the text generated so far. With
``final=False`` it holds back what more text could still change (a partial
marker), so every partial result is a prefix of the final one: streaming the
differences rebuilds exactly the non-streamed result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from tokenmill.parsers.tools.base import held_back
from tokenmill.structured_output.state import ReasoningMarkers

__all__ = ["ReasoningParser", "ReasoningSplit", "held_back"]


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    """The reasoning text (None: the output had no reasoning block)."""
    content: str
    """The rest: the answer."""


class ReasoningParser(ABC):
    """One request's view: ``open_at_start`` says the prompt ended inside a reasoning block
    (the chat template opened it), so the output starts with reasoning."""

    start: str
    """The marker that opens a reasoning block."""
    end: str
    """The marker that closes it."""

    def __init__(self, open_at_start: bool = False) -> None:
        self.open_at_start = open_at_start

    @abstractmethod
    def split(self, text: str, final: bool) -> ReasoningSplit:
        """Reasoning and content of ``text``; see the module docstring for ``final``."""

    @classmethod
    def markers(cls, tokenizer) -> ReasoningMarkers:
        """The markers as token ids of ``tokenizer`` (what the engine's grammar gate watches)."""

        def ids(marker: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(marker, add_special_tokens=False))

        return ReasoningMarkers(ids(cls.start), ids(cls.end))

    @classmethod
    def for_prompt(cls, tokenizer, prompt_token_ids: list[int]) -> ReasoningParser:
        """The parser of one request, knowing whether its prompt left a block open."""
        return cls(cls.markers(tokenizer).open_in(prompt_token_ids))
