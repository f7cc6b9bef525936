"""Streaming detokenization: text deltas as tokens arrive, never half a character.

Decoding each new token alone is wrong twice over: a multi-byte character split
across tokens decodes to U+FFFD, and SentencePiece drops the space of a leading
``▁``. So each step decodes a short window that starts a few tokens back
(``prefix_offset``) and emits what the window adds beyond the text already emitted
for its first part (``read_offset``); a window whose text ends in U+FFFD is held back
until the next token completes the character (the scheme of vLLM and TGI).

The window starts in the last prompt tokens, so the first output token keeps its
leading space ("The capital is" -> " Paris"). Hence the concatenation of the deltas
equals ``decode(prompt_tail + output)`` minus ``decode(prompt_tail)``; for
byte-level BPE that is exactly ``tokenizer.decode(output_ids)``, and for a
SentencePiece tokenizer whose decoder strips a leading space (Llama) it is that plus
the first token's space. With ``prompt_ids=[]`` it is always ``decode(output_ids)``.
"""

from __future__ import annotations

from tokenmill.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the output, for the first token's leading space."""


class IncrementalDetokenizer:
    """Feeds on output token ids; ``output_text`` is everything emitted so far."""

    output_text: str

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        # ids = prompt tail + output; text of ids[prefix_offset:read_offset] is already out.
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def append(self, new_ids: list[int]) -> str:
        """Add output tokens; return the text they finished (possibly "")."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an unfinished character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        if not final and (len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a character still incomplete
        delta = text[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens)
