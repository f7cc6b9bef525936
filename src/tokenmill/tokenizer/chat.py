"""Checks on chat messages before a template sees them, with errors that say what to fix."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.errors import InvalidRequestError

_CONTENT_TYPES = (str, list, type(None))


def validate_conversation(conversation: Any) -> None:
    """A non-empty list of {"role": str, "content": str | list[part] | None} dicts.

    ``content`` may be None or missing only on a message carrying ``tool_calls``.
    """
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise InvalidRequestError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"not {type(conversation).__name__}"
        )
    if not conversation:
        raise InvalidRequestError("messages is empty; send at least one message")
    for i, message in enumerate(conversation):
        _validate_message(i, message)


def _validate_message(i: int, message: Any) -> None:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(
            f"messages[{i}] is a {type(message).__name__}; each message must be a dict "
            "like {'role': 'user', 'content': 'Hi'}"
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(
            f"messages[{i}] has no 'role' (e.g. 'system', 'user', 'assistant')"
        )
    content = message.get("content")
    if not isinstance(content, _CONTENT_TYPES):
        raise InvalidRequestError(
            f"messages[{i}]['content'] is a {type(content).__name__}; use a string or a list of parts"
        )
    if content is None and not message.get("tool_calls"):
        raise InvalidRequestError(f"messages[{i}] ({role}) has no 'content'")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(
                f"messages[{i}]['content'][{j}] must be a dict with a 'type', "
                "e.g. {'type': 'text', 'text': 'Hi'}"
            )


def with_tool_arguments(message: Any) -> Any:
    """An assistant message's ``tool_calls[].function.arguments`` as a dict, as chat
    templates expect (OpenAI clients send them as JSON text; a template would print that
    text as a quoted string)."""
    calls = message.get("tool_calls") if isinstance(message, Mapping) else None
    if not isinstance(calls, list):
        return message
    fixed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError as e:
                raise InvalidRequestError(
                    f"a tool call's arguments are not JSON ({e}); send them as a JSON object "
                    "in a string, as the OpenAI API does"
                ) from e
            call = {**call, "function": {**fn, "arguments": args}}
        fixed.append(call)
    return {**message, "tool_calls": fixed}
