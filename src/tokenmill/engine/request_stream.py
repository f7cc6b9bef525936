"""One request's outputs as an async stream.

``AsyncLLM``'s engine thread puts the engine's outputs (and errors) on each stream's
queue through the stream's event loop. They come in the ``output_kind`` the caller asked
for: the engine's output processor is the one place that folds kinds (a FINAL_ONLY
request costs no per-step output at all).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind

ACCEPTED = object()
"""First item of a stream: the engine queued the request."""


class _Owner(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """One request's outputs, in the ``output_kind`` the caller asked for.

    An async iterator that ends after the finished output. Engine errors that end
    the request (``QueueTimeoutError``, ``EngineDeadError``) are raised from it.
    ``close()`` before the end aborts the request.
    """

    def __init__(
        self,
        request_id: str,
        owner: _Owner,
        loop: asyncio.AbstractEventLoop,
        kind: RequestOutputKind,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.kind = kind
        self.arrival = time.monotonic()
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        """Called on the stream's event loop: an output, ``ACCEPTED`` or an error."""
        self._queue.put_nowait(item)

    async def wait_accepted(self) -> None:
        """Returns once the engine queued the request; raises what refused it."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is ACCEPTED

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            assert isinstance(item, RequestOutput)
            self.finished = item.finished
            return item
        raise StopAsyncIteration

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()
