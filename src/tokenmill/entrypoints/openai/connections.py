"""uvicorn's HTTP/1.1 protocol with a deadline for the request headers.

uvicorn closes a keep-alive connection that stays idle after a response
(``timeout_keep_alive``), but a connection that opens and then trickles its
headers (or sends nothing) is never timed out: 400 such sockets stay open
forever (slowloris). ``HeaderTimeoutProtocol`` starts a timer when a connection
opens and after every response; unless a request's headers are complete when it
fires, the connection is closed.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutProtocol(H11Protocol):
    timeout_headers: float = 10.0
    """Seconds a client has to send a request's headers (set by ``with_header_timeout``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the request runs as long as it needs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.timeout_headers, self._expire)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` option, with this header deadline."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"timeout_headers": seconds})
