"""What enters the engine at the boundary: immutable request descriptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
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
        req.cache_key = self.cache_salt.encode() if self.cache_salt else b""
        req.reuse_context = self.reuse_context
        req.cache_generated_tokens = self.cache_generated_tokens


@dataclass(frozen=True)
class EngineRequest:
    """One user request as it enters ``LLMEngine.add_request``: tokenized and validated
    at the boundary, never changed afterwards. The scheduler builds its own mutable
    ``Request`` record (one per sequence: ``n > 1`` fans out) from it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    prompt: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
