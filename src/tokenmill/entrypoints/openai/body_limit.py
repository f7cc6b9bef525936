"""``BodyLimitMiddleware``: a request body over ``max_request_body_bytes`` is a 413 before
it is read in full (from its Content-Length, or as soon as the bytes received pass the
cap), and a POST body that is not JSON gets a 400 that says so.

Plain ASGI: the body is read here, at most ``max_bytes`` of it, and replayed to the app;
after the body the app's ``receive`` is the server's own (disconnects still arrive).

Before a 413 the rest of the body is read and dropped (up to ``DRAIN_BYTES`` more, for at
most ``DRAIN_SECONDS``): a server that closes a socket with unread bytes in it resets the
connection, and the client, still sending, can lose the 413 itself (seen as "server
disconnected without sending a response" on a 20 MB body).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.errors import APIError

_JSON_TYPES = ("application/json", "text/json")
DRAIN_BYTES = 64 << 20
"""Most body bytes read and dropped past the limit before answering 413; a client that
sends more gets the 413 and a closed connection."""
DRAIN_SECONDS = 10.0


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= self.max_bytes + DRAIN_BYTES:
                await _drain(receive)
            return await self._too_large(scope, receive, send, int(length))
        if not _is_json(headers.get(b"content-type")):
            kind = headers[b"content-type"].decode("latin-1")
            error = APIError(
                400,
                f"the body must be JSON sent with 'Content-Type: "
                f"application/json'; this request's Content-Type is {kind!r}",
                code="unsupported_content_type",
            )
            return await error.response()(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                return await self._too_large(scope, receive, send, None)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(
        self, scope: Scope, receive: Receive, send: Send, length: int | None
    ) -> None:
        size = f"{length} bytes" if length is not None else "more bytes"
        error = APIError(
            413,
            f"the request body has {size} than the server's limit of "
            f"{self.max_bytes} bytes (--max-request-body-bytes)"
            if length is None
            else f"the request body has {size}, over the "
            f"server's limit of {self.max_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await error.response()(scope, receive, send)


async def _drain(receive: Receive) -> None:
    """Read and drop the body's remaining chunks: at most ``DRAIN_BYTES``, for at most
    ``DRAIN_SECONDS``, until the last chunk or the client leaves."""

    async def read() -> None:
        dropped = 0
        while dropped <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(read(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        return


def _is_json(content_type: bytes | None) -> bool:
    """No Content-Type (parsed as JSON, as FastAPI does), or a JSON one (+json too)."""
    if content_type is None:
        return True
    kind = content_type.split(b";")[0].strip().decode("latin-1").lower()
    return kind in _JSON_TYPES or kind.endswith("+json")
