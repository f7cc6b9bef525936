"""Checks on chat messages before a template sees them, with errors that say what to fix."""

from __future__ import annotations

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
