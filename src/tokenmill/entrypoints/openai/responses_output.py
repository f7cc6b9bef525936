"""OpenAI's Responses API: the output items and the response object built from a parsed
answer (the request side: ``protocol_responses.py``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import OpenAIModel, answered_tier
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest, item_id
from tokenmill.parsers.tools import ToolCall


def reasoning_item(text: str, summary: bool, rid: str | None = None) -> dict[str, Any]:
    """The reasoning text as ``content`` (reasoning_text, as vLLM returns it) and, when the
    request asked for a summary (``wants_summary``), as the summary too."""
    return {
        "type": "reasoning",
        "id": rid or item_id("rs"),
        "status": "completed",
        "summary": [{"type": "summary_text", "text": text}] if summary else [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(
    text: str,
    mid: str | None = None,
    status: str = "completed",
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": mid or item_id("msg"),
        "role": "assistant",
        "status": status,
        "content": [output_text(text, logprobs)],
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; ``logprobs``: one {token, logprob, bytes, top_logprobs} per token
    (empty unless the request included them)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(
    call: ToolCall, call_id: str, fid: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": fid or item_id("fc"),
        "call_id": call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class ResponseObject(OpenAIModel):
    """The ``response`` object (also the payload of response.created/completed events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    usage: dict[str, Any] | None = None

    @classmethod
    def start(cls, rid: str, model: str, req: ResponsesRequest) -> ResponseObject:
        return cls(
            id=rid,
            model=model,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tools=req.tools or [],
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            text=req.text or {"format": {"type": "text"}},
            reasoning=req.reasoning or {"effort": None, "summary": None},
            previous_response_id=req.previous_response_id,
            store=req.store,
            metadata=req.metadata or {},
            user=req.user,
            truncation=req.truncation,
            service_tier=answered_tier(req.service_tier),
            top_logprobs=req.top_logprobs,
        )


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def finish(resp: ResponseObject, finish_reason: str | None) -> None:
    """Status from the finish reason: a cut answer is incomplete (max_output_tokens)."""
    if finish_reason == "length":
        resp.status = "incomplete"
        resp.incomplete_details = {"reason": "max_output_tokens"}
    elif finish_reason == "cancelled":
        resp.status = "cancelled"
    else:
        resp.status = "completed"
