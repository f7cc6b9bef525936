"""``BodyLimitMiddleware`` reads the rest of an over-limit body before its 413, so the
server never closes a socket with unread bytes (which resets the connection and can lose
the 413 at a client that is still sending); past ``DRAIN_BYTES`` it answers at once."""

from __future__ import annotations

import asyncio
import json

from tokenmill.entrypoints.openai import body_limit
from tokenmill.entrypoints.openai.body_limit import BodyLimitMiddleware

MB = 1 << 20


async def _never_called(scope, receive, send):  # the app behind the limit
    raise AssertionError("an over-limit body reached the app")


def _post(total: int, declared: int | None, chunk: int = MB):
    """(scope, receive, sent messages, [chunks read so far], chunks in all) for a body of
    ``total`` bytes sent in ``chunk``-byte pieces, with Content-Length ``declared``."""
    headers = [(b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    pieces = [min(chunk, total - i) for i in range(0, total, chunk)]
    read = [0]
    sent: list[dict] = []

    async def receive():
        if read[0] >= len(pieces):
            await asyncio.sleep(3600)  # nothing more: the server would wait here
        read[0] += 1
        return {
            "type": "http.request",
            "body": b" " * pieces[read[0] - 1],
            "more_body": read[0] < len(pieces),
        }

    return scope, receive, sent, read, len(pieces)


def _status_and_code(sent: list[dict]) -> tuple[int, str]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)["error"]["code"]


def test_a_declared_oversize_body_is_read_before_the_413():
    scope, receive, sent, read, pieces = _post(20 * MB, 20 * MB)
    asyncio.run(BodyLimitMiddleware(_never_called, 1 * MB)(scope, receive, send=sent_to(sent)))
    assert _status_and_code(sent) == (413, "request_too_large")
    assert read[0] == pieces  # every chunk consumed


def test_a_streamed_body_that_passes_the_limit_is_read_before_the_413():
    scope, receive, sent, read, pieces = _post(5 * MB, None)
    asyncio.run(BodyLimitMiddleware(_never_called, 2 * MB)(scope, receive, send=sent_to(sent)))
    assert _status_and_code(sent) == (413, "request_too_large")
    assert read[0] == pieces


def test_beyond_the_drain_bound_the_413_comes_at_once(monkeypatch):
    monkeypatch.setattr(body_limit, "DRAIN_BYTES", 4 * MB)
    scope, receive, sent, read, _ = _post(64 * MB, 64 * MB)
    asyncio.run(BodyLimitMiddleware(_never_called, 1 * MB)(scope, receive, send=sent_to(sent)))
    assert _status_and_code(sent) == (413, "request_too_large") and read[0] == 0


def test_a_client_that_stops_sending_does_not_hold_the_413(monkeypatch):
    monkeypatch.setattr(body_limit, "DRAIN_SECONDS", 0.2)
    scope, receive, sent, read, _ = _post(3 * MB, 20 * MB)  # declares more than it sends
    asyncio.run(BodyLimitMiddleware(_never_called, 1 * MB)(scope, receive, send=sent_to(sent)))
    assert _status_and_code(sent) == (413, "request_too_large") and read[0] == 3


def sent_to(sent: list[dict]):
    async def send(message):
        sent.append(message)

    return send
