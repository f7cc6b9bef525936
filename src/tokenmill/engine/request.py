"""What enters the engine at the boundary with a request, besides its SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenmill.kv_cache.prefix import BlockKey
    from tokenmill.multimodal.inputs import MultiModalInputs
    from tokenmill.scheduler.request import Request


@dataclass(frozen=True)
class RequestOptions:
    """Per-request engine options besides sampling (vLLM / Edge-LLM names)."""

    priority: int = 0
    """Lower runs first; FCFS within a priority."""
    cache_salt: str | None = None
    """Isolates prefix-cache sharing: only requests with the same salt share blocks."""
    reuse_context: bool = True
    """Read KV cached by earlier requests."""
    cache_generated_tokens: bool = True
    """Also cache the KV of the generated tokens (multi-turn reuse), not only the prompt."""
    multimodal: MultiModalInputs | None = None
    """The prompt's processed media (``multimodal/processing.py``); None: text only."""

    def __post_init__(self) -> None:
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(
                f"cache_salt must be a string, got {type(self.cache_salt).__name__}"
            )

    def apply(self, req: Request) -> None:
        """Copy the options onto the scheduler's record of the request."""
        req.priority = self.priority
        req.cache_key = self.block_key()
        req.reuse_context = self.reuse_context
        req.cache_generated_tokens = self.cache_generated_tokens
        if self.multimodal is not None:
            req.mm_inputs = self.multimodal

    def block_key(self) -> BlockKey:
        """The prefix cache's extra key of the request's blocks: the
        ``cache_salt``, with the hashes of the media each block covers."""
        salt = self.cache_salt.encode() if self.cache_salt else b""
        if self.multimodal is None:
            return salt
        from tokenmill.multimodal.prefix_keys import media_block_keys

        return media_block_keys(salt, self.multimodal)
