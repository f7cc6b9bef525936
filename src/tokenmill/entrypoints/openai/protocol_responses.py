"""OpenAI's Responses API: the request body, what of it is refused, and its translation
to a chat request (the output side: ``responses_output.py``)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    Refused,
    RequestModel,
)
from tokenmill.sampling_params import MAX_LOGPROBS

BUILT_IN_TOOLS = (
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "custom",
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE: dict[str, str | None] = {
    INCLUDE_LOGPROBS: None,
    "reasoning.encrypted_content": "reasoning items carry their text in the clear and are "
    "not shown to the model again; omit it (send the reasoning item itself back)",
    # what these fill comes from built-in tools or image inputs, which are 400s here:
    # a request that can run has nothing for them to add
    "file_search_call.results": None,
    "web_search_call.results": None,
    "web_search_call.action.sources": None,
    "message.input_image.image_url": None,
    "computer_call_output.output.image_url": None,
    "code_interpreter_call.outputs": None,
}
"""``include`` values: None = honoured; a string = refused, and why."""
REASONING_SUMMARIES = (None, "auto", "detailed")
"""A reasoning item's content is the model's reasoning text; asked for a summary, the item
also carries that text, unabridged, as its summary: the "auto" and "detailed" summaries.
A "concise" one would need a summarizer (a 400). Without ``summary`` the summary is
empty, as OpenAI's."""


class ResponsesRequest(RequestModel):
    refused: ClassVar[dict[str, Refused]] = {
        "background": Refused(
            "there are no background responses; leave it false (stream=true shows progress)",
            (None, False),
        ),
        "background_options": Refused("background responses are not supported"),
        "truncation": Refused(
            "truncation='auto' (dropping input items to fit the context) is not "
            "implemented; a conversation that does not fit is a 400",
            (None, "disabled"),
        ),
        "conversation": Refused("there is no Conversations API here; use previous_response_id"),
        "prompt": Refused("there are no stored prompt templates; send instructions and input"),
        "max_tool_calls": Refused("the number of tool calls cannot be capped"),
        "context_management": Refused("context compaction is not implemented"),
        "moderation": Refused("there is no moderation"),
        "access_programs": Refused("there are no access programs"),
        "image": Refused("this server has no image output"),
    }

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    """{"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"},
    "verbosity": "medium"} (no other verbosity can be set)."""
    reasoning: dict[str, Any] | None = None
    """{"effort": ..., "summary": ...}: effort goes to the chat template; a summary is the
    reasoning text itself (``REASONING_SUMMARIES``, ``wants_summary``)."""
    include: list[str] | None = None
    """``INCLUDABLE``: "message.output_text.logprobs" puts logprobs on output_text parts."""
    top_logprobs: int | None = None
    """Alternatives per token (0..20) in those logprobs; needs the include above."""
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    """{"include_obfuscation": false}: deltas carry no obfuscation padding."""
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    """An end-user id, like ``user``: accepted, not used."""
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    """Cache hints: prefix caching here is automatic; the answer does not depend on them."""
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    """Accepted and echoed back ("auto" answers "default"): there is one tier here."""
    seed: int | None = None
    """tokenmill: a per-request sampling seed."""

    @property
    def logprobs(self) -> int | None:
        """The engine's ``logprobs``: None (not included) or alternatives per token."""
        if INCLUDE_LOGPROBS not in (self.include or ()):
            return None
        return self.top_logprobs or 0


def wants_summary(req: ResponsesRequest) -> bool:
    """Whether reasoning items carry a summary (``reasoning.summary``, or its older name
    ``generate_summary``); the reasoning text is their content either way."""
    reasoning = req.reasoning or {}
    return (reasoning.get("summary") or reasoning.get("generate_summary")) is not None


def check_request(req: ResponsesRequest) -> None:
    """Refuse every field set to something this server does not honour (a 400 naming it)."""
    req.check_fields()
    for value in req.include or ():
        if value not in INCLUDABLE:
            raise bad_request(
                f"include value {value!r} is unknown; known: {', '.join(INCLUDABLE)}", "include"
            )
        if INCLUDABLE[value] is not None:
            raise bad_request(f"include {value!r} is not supported: {INCLUDABLE[value]}", "include")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                "top_logprobs",
            )
        if req.top_logprobs and req.logprobs is None:
            raise bad_request(
                f"top_logprobs needs include: [{INCLUDE_LOGPROBS!r}] (logprobs are returned "
                "only when included)",
                "top_logprobs",
            )
    _check_keys("reasoning", req.reasoning, {"effort": None, "summary": REASONING_SUMMARIES,
                "generate_summary": REASONING_SUMMARIES, "mode": (None, "standard"),
                "context": (None,)})  # fmt: skip
    _check_keys("text", req.text, {"format": None, "verbosity": (None, "medium")})
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    _check_keys("stream_options", req.stream_options, {"include_obfuscation": (None, False)})


def _check_keys(
    name: str, value: dict[str, Any] | None, allowed: dict[str, tuple[Any, ...] | None]
) -> None:
    """Each key of ``value`` must be in ``allowed``, with one of the values listed there
    (None: any value)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object", name)
    for key, v in value.items():
        if key not in allowed:
            raise bad_request(
                f"{name}.{key} is not supported (supported: {', '.join(allowed)})", name
            )
        ok = allowed[key]
        if ok is not None and v not in ok:
            raise bad_request(
                f"{name}.{key}={v!r} is not supported; supported: {', '.join(repr(x) for x in ok)}",
                f"{name}.{key}",
            )


# -- request -> chat messages ---------------------------------------------------------------
def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``input`` as a list of items, each with an id (what input_items lists)."""
    if isinstance(req.input, str):
        return [
            {
                "type": "message",
                "id": item_id("msg"),
                "role": "user",
                "status": "completed",
                "content": [{"type": "input_text", "text": req.input}],
            }
        ]
    items = []
    for i, item in enumerate(req.input):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind not in ("message", "function_call", "function_call_output", "reasoning"):
            raise bad_request(
                f"input[{i}] has type {kind!r}; supported: message, "
                "function_call, function_call_output, reasoning",
                "input",
            )
        item = {**item, "type": kind}
        item.setdefault(
            "id",
            item_id({"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(kind, "fco")),
        )
        if kind == "message" and isinstance(item.get("content"), str):
            text_type = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": text_type, "text": item["content"]}]
        items.append(item)
    return items


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input or output items -> chat messages (consecutive calls share one assistant turn)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                    "input",
                )
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(i, item.get("content")),
                }
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if not all(
                isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))
            ):
                raise bad_request(
                    f"input[{i}] (function_call) needs call_id, name and arguments strings", "input"
                )
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise bad_request(
                    f"input[{i}] (function_call_output) needs call_id and output", "input"
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else _text_of(i, output),
                }
            )
        # reasoning items are not shown to the model again
    return messages


def _text_of(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text"):
            raise bad_request(
                f"input[{i}].content has a part of type {kind!r}; only text parts are supported",
                "input",
            )
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def to_chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that answers ``req`` after ``history`` (previous_response_id)."""
    messages = list(history)
    if req.instructions:
        messages = [
            {"role": "system", "content": req.instructions},
            *[m for m in messages if m["role"] != "system"],
        ]
    messages += to_messages(items)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "logprobs": req.logprobs is not None,
        "top_logprobs": req.logprobs,
        "parallel_tool_calls": req.parallel_tool_calls,
        "tools": _chat_tools(req.tools),
        "response_format": _response_format(req.text),
    }
    if req.tools:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    return ChatCompletionRequest(**body)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            what = "a built-in tool" if kind in BUILT_IN_TOOLS else "an unknown tool type"
            raise bad_request(
                f"tools[{i}] is {what} ({kind!r}); only function tools are supported", "tools"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        f"tool_choice {choice!r} is not supported; use auto, none, required or "
        '{"type": "function", "name": ...}',
        "tool_choice",
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "response"),
                "schema": fmt.get("schema"),
                "strict": fmt.get("strict"),
            },
        }
    raise bad_request(
        f"text.format type {fmt.get('type')!r} is not supported; use text, "
        "json_object or json_schema",
        "text",
    )
