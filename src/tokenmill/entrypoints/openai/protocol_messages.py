"""Anthropic's Messages API: the request body, its translation to a chat request, the
response's content blocks and Anthropic's error bodies."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field

from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` with the same HTTP status."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": error.message}},
        status_code=error.status,
        headers=error.headers,
    )


def block_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class CountTokensRequest(OpenAIModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        messages += _to_chat(i, message)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "tools": _tools(req.tools)}
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
    choice = req.tool_choice or {"type": "auto"}
    if req.tools:
        body["tool_choice"] = _tool_choice(choice)
        body["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    if req.thinking is not None:
        enabled = req.thinking.get("type") == "enabled"
        body["chat_template_kwargs"] = {"enable_thinking": enabled}
    return ChatCompletionRequest(**body)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"{where} has a {kind!r} block; only text blocks are supported here", where
            )
        parts.append(block.get("text", ""))
    return "\n".join(parts)


def _to_chat(i: int, message: Any) -> list[dict[str, Any]]:
    where = f"messages.{i}"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be user or assistant, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input", {})),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text(result, f"{where}.content.{j}")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise bad_request(
                f"{where}.content.{j}: a {kind!r} block is not supported in a "
                f"{role} message (text, tool_use, tool_result)",
                "messages",
            )
    out = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "custom") not in ("custom", None)
            or "input_schema" not in tool
        ):
            raise bad_request(
                f"tools.{i}: only client tools {{name, description, "
                "input_schema}} are supported (server tools are not)",
                "tools",
            )
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f'tool_choice {choice!r}: use auto, any, none or {{"type": "tool", "name": ...}}',
        "tool_choice",
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as a tool_use block's ``input`` (an object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


def stop_reason(finish_reason: str | None, stop: Any, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessageObject(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, Any] = Field(default_factory=dict)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
