"""One request's mutable state, owned by the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.kv_cache.prefix import BlockKey
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.multimodal.inputs import MultiModalInputs
    from tokenmill.structured_output.state import StructuredRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "cancelled"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        # Identity tests: read several times per request per step, a tuple lookup cost 0.5 us.
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING


_WAITING, _RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


@dataclass(eq=False)
class Request:
    """Progress is counted in tokens: ``num_computed_tokens`` catches up to ``num_tokens``.

    One rule covers prefill, chunked prefill and decode: each step computes some
    of the tokens not yet in the KV cache, and when it reaches the end a new
    token is sampled. Preemption resets ``num_computed_tokens`` to 0 (recompute).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Resolved output budget: params.max_tokens, or what is left of max_model_len."""
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    """The request's own RNG when params.seed is set (on the logits' device)."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_hooks: tuple = ()
    """The request hooks that see this sequence's new tokens (``RequestHook.watches``)."""
    last_token_time: float | None = None
    """When the latest output tokens arrived (inter-token latency)."""
    priority: int = 0
    """Lower runs first; FCFS within a priority."""
    cache_key: BlockKey = b""
    """Extra prefix-cache key (tenant salt): blocks are shared only between equal keys."""
    reuse_context: bool = True
    """Read cached KV of earlier requests (False: compute the whole prompt)."""
    cache_generated_tokens: bool = True
    """Commit generated tokens' KV to the prefix cache too (False: the prompt only)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    arrival_index: int = 0
    """Admission order tiebreak, set by the scheduler."""
    structured: StructuredRequest | None = None
    """Grammar state when params.structured_outputs is set (``structured_output/``)."""
    num_placeholders: int = 0
    """Tokens that scheduled steps will append whose ids are not on the host yet: the
    token each sampling step produces, counted from scheduling until its step's result
    is applied. 0 or 1 between steps; 2 for a moment with asynchronous scheduling, which
    schedules (and launches) the next step before the one in flight has returned."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for the next step (a proposer sets them before ``schedule``;
    scheduling consumes them). The step verifies them: an accepted prefix and one more
    token come back, rejected positions are rolled back."""
    spec_parents: list[int] | None = None
    """With a draft tree: the parent of each of ``spec_token_ids`` (-1: the last known
    token; ``worker/draft_tree.py``). None: the drafts are a chain."""
    num_drafts_in_flight: int = 0
    """Draft tokens of the step in flight: until it returns, how many tokens it yields is
    unknown, so the request is not scheduled again (no overlap with drafts)."""
    mm_inputs: MultiModalInputs | None = None
    """The prompt's media (placeholder runs, processed items, M-RoPE positions); the
    runner's multimodal step reads it (``multimodal/step.py``). None: text only."""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those a step in flight is sampling: what the KV cache will
        hold once all of them are computed."""
        return len(self.all_token_ids) + self.num_placeholders

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival."""
        return (self.priority, self.arrival_index)

    @property
    def cacheable_tokens(self) -> list[int]:
        """Tokens whose KV may go to the prefix cache."""
        return self.all_token_ids if self.cache_generated_tokens else self.prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        status = self.status
        return status is not _WAITING and status is not _RUNNING  # RequestStatus.is_finished

    def append_token(self, token_id: int) -> None:
        """A new token has arrived (sampled, or an accepted draft)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop conditions after appending a token (stop strings come later)."""
        outputs, params = self.output_token_ids, self.params  # (per request per step)
        last, num_outputs = outputs[-1], len(outputs)
        if num_outputs >= params.min_tokens:
            if last in self.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_outputs >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` outputs (a stop string ended the request
        inside a multi-token step: what follows it is not part of the answer)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self.all_token_ids[len(self.all_token_ids) - drop :]
