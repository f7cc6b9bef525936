"""Rendering a chat template that came with a request (``--trust-request-chat-template``).

Jinja's sandbox blocks attribute escapes but not cost: nested ``range()`` loops run
for hours and ``'x' * 300000000`` allocates hundreds of MB. ``render_untrusted``
renders in a sandbox that also bounds

- time: a trace function on the template's own frames raises once the deadline
  passes (the loop it is in stops at its next line);
- output: the rendered text is streamed and cut at ``max_chars``;
- single operations: ``*``/``**`` results over ``max_chars`` and ranges over
  ``MAX_RANGE`` items are refused before they are built.

The model's own template and the server's ``--chat-template`` are trusted and
rendered the usual way (``Tokenizer.apply_chat_template``).
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import InvalidRequestError

MAX_RANGE = 10_000
"""Items one ``range()`` call may make."""


class TemplateLimitError(InvalidRequestError):
    """A request's chat template took too long, or made too much text."""


class _Guarded(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        self.max_chars = max_chars
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.filters["tojson"] = _tojson

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
            size = len(left) * right
        elif operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            size = len(right) * left
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            size = right * max(abs(left), 2).bit_length() // 4  # digits, roughly
        else:
            size = 0
        if size > self.max_chars:
            raise TemplateLimitError(
                f"the chat template builds a value of {size} items (more than {self.max_chars})"
            )
        return super().call_binop(context, operator, left, right)

    @staticmethod
    def _range(*args: int) -> range:
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise TemplateLimitError(
                f"the chat template asks for range() of {len(r)} items (at most {MAX_RANGE})"
            )
        return r


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)


def render_untrusted(template: str, context: dict[str, Any], timeout: float, max_chars: int) -> str:
    """Render ``template`` with ``context`` within ``timeout`` seconds and ``max_chars``
    characters of output; raises ``InvalidRequestError`` (a 400) otherwise."""
    env = _Guarded(max_chars)
    deadline = time.monotonic() + timeout
    try:
        compiled = env.from_string(template)
    except TemplateError as e:
        raise InvalidRequestError(f"the request's chat_template does not compile: {e}") from e
    code_names = {"<template>", compiled.name}

    def local(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateLimitError(
                f"the chat template took longer than {timeout:g} s to render "
                "(server flag --chat-template-timeout)"
            )
        return local

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename in code_names else None

    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for chunk in compiled.generate(**context):
            size += len(chunk)
            if size > max_chars:
                raise TemplateLimitError(
                    f"the chat template renders more than {max_chars} characters"
                )
            parts.append(chunk)
    except TemplateLimitError:
        raise
    except (
        TemplateError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        OverflowError,
        RecursionError,
    ) as e:
        raise InvalidRequestError(
            f"the request's chat_template can not render these messages: {type(e).__name__}: {e}"
        ) from e
    finally:
        sys.settrace(previous)
    return "".join(parts)


def template_context(
    tokenizer,
    conversation: list[dict],
    tools: list | None,
    add_generation_prompt: bool,
    **kwargs: Any,
) -> dict[str, Any]:
    """The variables chat templates expect (HF's names), from a tokenizer's special tokens."""
    hf = tokenizer.hf
    special = {
        name: getattr(hf, name, None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    return {
        **special,
        **kwargs,
        "messages": conversation,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
    }
