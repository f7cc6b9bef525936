"""Pydantic models of the OpenAI-compatible API: requests (OpenAI + vLLM extra fields)
and responses.

A request field is honoured, or refused: the fields of OpenAI's (and vLLM's) API that
this server does not honour are listed in each request's ``refused`` table, and a
request that sets one to anything but a harmless value is a 400 naming it
(``RequestModel.check_fields``). Fields no API defines are ignored and logged, as vLLM
does."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from tokenmill.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)

SYSTEM_FINGERPRINT = "tokenmill"
"""OpenAI's ``system_fingerprint``: which backend configuration answered."""
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def answered_tier(asked: str | None) -> str | None:
    """The ``service_tier`` a response reports: the one asked for ("auto" is "default")."""
    return "default" if asked == "auto" else asked


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OmitNone(OpenAIModel):
    """Fields named in ``omit_if_none`` are left out when None: OpenAI's schema wants an
    array or an object there, or nothing (``"tool_calls": null`` fails strict validators)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {
            k: v for k, v in handler(self).items() if v is not None or k not in self.omit_if_none
        }


# -- requests -------------------------------------------------------------------------
@dataclass(frozen=True)
class Refused:
    """A field this server does not honour: a 400 (with ``reason``) unless its value is one
    of ``harmless`` (what asks for nothing: absent, null, the API's default)."""

    reason: str
    harmless: tuple[Any, ...] = (None,)


class RequestModel(OpenAIModel):
    """A request body; ``check_fields`` refuses what is set but not honoured."""

    model_config = ConfigDict(extra="allow")
    refused: ClassVar[dict[str, Refused]] = {}

    def check_fields(self) -> None:
        extra = self.model_extra or {}
        for name, rule in self.refused.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if not any(value == ok and type(value) is type(ok) for ok in rule.harmless):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise bad_request(f"{name}={shown} is not supported: {rule.reason}", name)
        unknown = sorted(set(extra) - set(self.refused))
        if unknown:
            logger.warning("ignoring request fields this API does not define: %s", unknown)


_NO_STORE = "this server keeps no stored chat completions (omit it or set it to false)"
_SAMPLING_REFUSED = {
    "use_beam_search": Refused("beam search is not implemented", (None, False)),
    "length_penalty": Refused("it only applies to beam search", (None, 1.0, 1)),
    "return_tokens_as_token_ids": Refused("tokens are returned as text", (None, False)),
    "prompt_embeds": Refused("prompts are text or token ids"),
    "kv_transfer_params": Refused("there is no KV transfer (disaggregated serving)"),
    "vllm_xargs": Refused("there are no custom sampling extensions"),
    "logits_processors": Refused(
        "logits processors are per-request callables of the Python API (SamplingParams), "
        "not named in a request body"
    ),
}
"""vLLM's extra fields that change results and are not honoured here."""


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send a last chunk with empty choices and the request's usage."""
    continuous_usage_stats: bool = False
    """vLLM: every chunk carries the usage so far."""


class SamplingRequest(RequestModel):
    """Fields shared by chat and text completions."""

    refused: ClassVar[dict[str, Refused]] = _SAMPLING_REFUSED

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """Accepted and echoed back ("auto" answers "default"): there is one tier here."""
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    echo: bool = False
    priority: int = 0
    """vLLM: lower is scheduled first (FCFS within a priority)."""
    disable_spec_decode: bool = False
    """Never verify draft tokens for this request (when the server speculates)."""
    truncate_prompt_tokens: int | None = None
    """vLLM: keep only the last k prompt tokens."""
    allowed_token_ids: list[int] | None = None
    """vLLM: only these token ids may be generated."""
    bad_words: list[str] | None = None
    """vLLM: words that may not be generated (``SamplingParams.bad_words``)."""
    cache_salt: str | None = None
    """vLLM: only requests with the same salt share prefix-cache blocks."""
    # structured output: at most one of these (see entrypoints/openai/structured.py)
    response_format: dict[str, Any] | None = None
    """OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema"}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM: {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}."""
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: Literal["auto", "guidance", "llguidance"] | None = None
    """vLLM's per-request backend: only the engine's (llguidance) can be named, as vLLM v1
    refuses a backend other than its engine's."""


class ChatCompletionRequest(SamplingRequest):
    refused: ClassVar[dict[str, Refused]] = {
        **_SAMPLING_REFUSED,
        "functions": Refused("use tools (the deprecated functions field is not read)"),
        "function_call": Refused("use tool_choice (the deprecated field is not read)"),
        "audio": Refused("this server answers in text only"),
        "modalities": Refused("this server answers in text only", (None, ["text"])),
        "prediction": Refused("predicted outputs are not implemented"),
        "store": Refused(_NO_STORE, (None, False)),
        "verbosity": Refused("the model's verbosity cannot be set", (None, "medium")),
        "web_search_options": Refused("there is no built-in web search"),
        "moderation": Refused("there is no moderation"),
        "documents": Refused("documents are not passed to the chat template"),
        "return_token_ids": Refused("token ids are not returned"),
        "add_special_tokens": Refused(
            "the chat template writes the special tokens (false is what is done)", (None, False)
        ),
    }

    messages: list[dict[str, Any]]
    mm_processor_kwargs: dict[str, Any] | None = None
    """Image-processor options of this request (vLLM's field): min_pixels, max_pixels."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    """Passed to the chat template (as chat_template_kwargs["reasoning_effort"])."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's fields that ask for nothing this server could do otherwise
    metadata: dict[str, str] | None = None
    """Tags of a stored completion: without ``store`` they have no effect (as at OpenAI)."""
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    """Cache hints: prefix caching here is automatic (``cache_salt`` isolates); the answer
    does not depend on them."""
    safety_identifier: str | None = None
    """An end-user id, like ``user``: accepted, not used."""


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    refused: ClassVar[dict[str, Refused]] = {
        **_SAMPLING_REFUSED,
        "return_token_ids": Refused("token ids are not returned"),
        "mm_processor_kwargs": Refused("completions take text only (send images to chat)"),
    }

    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template writes them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# -- responses ------------------------------------------------------------------------
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0
    audio_tokens: int = 0


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
        )


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatMessage(OmitNone):
    omit_if_none = frozenset({"reasoning_content", "tool_calls"})

    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    """Required by OpenAI's schema (nullable); this server never refuses."""
    reasoning_content: str | None = None
    """vLLM's extra: the reasoning parser's text (left out when there is none)."""
    tool_calls: list[dict[str, Any]] | None = None
    """[{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""


class ChatChoice(OpenAIModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(OmitNone):
    omit_if_none = frozenset({"service_tier"})

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str = SYSTEM_FINGERPRINT
    service_tier: str | None = None
    """Echoed when the request named one (left out otherwise)."""


class PromptLogprob(OpenAIModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: per prompt position, token id -> logprob (None for the first)."""


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any) -> dict[str, Any]:
        """A delta carries only what changed: no ``"role": null``."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoiceFull(CompletionChoice):
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoiceFull]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None
    task: str | None = None
    """generate, or a pooling model's task: embed, score, classify."""


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str
