"""Validate response bodies against the OpenAI schema fixture (schemas/openai_responses.json,
built from the openai SDK's types by schemas/build_openai_schemas.py; a unique module name:
tests/ folders share sys.path)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jsonschema

FIXTURE = Path(__file__).with_name("schemas") / "openai_responses.json"


@cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(FIXTURE.read_text())["schemas"][kind]
    return jsonschema.Draft202012Validator(schema)


def check(kind: str, body: dict) -> dict:
    """Raise naming every violation of the ``kind`` schema (e.g. "chat.completion")."""
    errors = sorted(_validator(kind).iter_errors(body), key=lambda e: list(e.path))
    if errors:
        lines = [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
        raise AssertionError(
            f"{kind} violates the schema:\n"
            + "\n".join(lines)
            + f"\nbody: {json.dumps(body)[:2000]}"
        )
    return body


def sse_events(lines) -> list[dict]:
    """The JSON payloads of an SSE stream, up to ``data: [DONE]`` (which must end it)."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        assert not done, "data after [DONE]"
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    return events
