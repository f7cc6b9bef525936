"""vLLM's prompt dicts (``vllm.inputs``): what ``LLM.generate`` accepts besides strings.
Both may also carry ``cache_salt`` (share prefix-cache blocks only with the same salt)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict, total=False):
    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str
    """Optional text reported back in ``RequestOutput.prompt``."""
    cache_salt: str
