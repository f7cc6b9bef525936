"""One request's outputs as an async stream, in the ``output_kind`` its caller asked for.

``AsyncLLM``'s engine thread puts DELTA outputs (and errors) on each stream's queue
through the stream's event loop; the stream folds them back into CUMULATIVE or
FINAL_ONLY outputs when those were asked for.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenmill.outputs import CompletionOutput, RequestOutput
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
        self._acc = _Accumulator()

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
            out = self._convert(item)
            if out is not None:
                return out
        raise StopAsyncIteration

    def _convert(self, delta: RequestOutput) -> RequestOutput | None:
        if self.kind is RequestOutputKind.DELTA:
            return delta
        merged = self._acc.add(delta)
        if self.kind is RequestOutputKind.CUMULATIVE:
            return _copy_output(merged)
        return merged if merged.finished else None

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


@dataclass
class _Accumulator:
    """Folds DELTA outputs into one cumulative ``RequestOutput``."""

    out: RequestOutput | None = None
    comps: dict[int, CompletionOutput] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> RequestOutput:
        for d in delta.outputs:
            comp = self.comps.setdefault(d.index, CompletionOutput(d.index, "", []))
            comp.text += d.text
            comp.token_ids = [*comp.token_ids, *d.token_ids]
            if d.logprobs is not None:
                comp.logprobs = [*(comp.logprobs or []), *d.logprobs]
            comp.cumulative_logprob = d.cumulative_logprob
            comp.finish_reason = d.finish_reason
            comp.stop_reason = d.stop_reason
        outputs = [self.comps[i] for i in sorted(self.comps)]
        earlier = self.out.prompt_logprobs if self.out is not None else None
        self.out = replace(delta, outputs=outputs, prompt_logprobs=delta.prompt_logprobs or earlier)
        return self.out


def _copy_output(out: RequestOutput) -> RequestOutput:
    return replace(out, outputs=[replace(c, token_ids=list(c.token_ids)) for c in out.outputs])
