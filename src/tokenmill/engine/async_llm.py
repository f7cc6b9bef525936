"""``AsyncLLM``: the engine in its own thread, an async stream of outputs per request.

The engine is single-owner. One thread (the *engine thread*) owns the
``LLMEngine`` and is the only one that touches it; the event loop (and any
other thread) sends it commands through a queue, like an actor:

- ``add``: queue a request (the engine validates it; a ``ValueError`` comes back
  to the caller of ``add_request``),
- ``abort``: cancel a request; its KV blocks are free before the next step,
- ``stop``: abort what is left and end the thread.

Between commands the thread runs ``engine.step()`` while there is work, so all
live requests batch together, and hands each request's outputs to the event
loop of the coroutine that added it (one ``call_soon_threadsafe`` per loop per
step). Outputs come in the request's own ``output_kind`` (the engine folds them).

Admission control happens on the caller's side, at once: more than
``max_queued_requests`` requests waiting to start raises ``QueueFullError``; a
request that waited longer than ``queue_timeout`` seconds to be scheduled is
dropped with ``QueueTimeoutError``; after ``stop_accepting()`` (draining) new
requests get ``DrainingError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.prompts import PromptInput, normalize_prompts
from tokenmill.engine.request import RequestOptions
from tokenmill.engine.request_stream import ACCEPTED, RequestStream
from tokenmill.errors import DrainingError, EngineDeadError, QueueFullError, QueueTimeoutError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.threads import release_openmp_threads

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    options: RequestOptions | None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread; the result goes to ``future``."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass
class _Live:
    """Engine-thread bookkeeping of one accepted request."""

    stream: RequestStream
    arrival: float
    started: bool = False


class AsyncLLM:
    """Async front end of one ``LLMEngine`` (which it owns until ``shutdown``)."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int | None = None,
        queue_timeout: float | None = None,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        if queue_timeout is not None and queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {queue_timeout}")
        self.engine = engine
        self.stats = engine.stats
        self.tokenizer = engine.tokenizer
        self.max_queued_requests = max_queued_requests
        self.queue_timeout = queue_timeout
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # admitted, not yet scheduled (guarded by _lock)
        self._num_live = 0  # admitted, not yet finished (guarded by _lock)
        self._accepting = True
        self._dead: BaseException | None = None
        # Owned by the engine thread:
        self._live: dict[str, _Live] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        """Start the engine thread; the front end is alive while the returned thread is.
        (``EngineCoreClient`` starts an engine process and a thread that reads it instead.)
        This thread built the engine; the engine thread computes from now on."""
        release_openmp_threads()
        thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        thread.start()
        return thread

    # -- state ------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        """Running, accepting and not failed."""
        return self._accepting and self._dead is None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting

    @property
    def num_queued(self) -> int:
        """Accepted requests not yet scheduled (what max_queued_requests bounds)."""
        return self._num_queued

    @property
    def num_live(self) -> int:
        """Accepted requests not yet finished."""
        return self._num_live

    # -- requests (any thread with a running event loop) ------------------------------
    async def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        options: RequestOptions | None = None,
    ) -> RequestStream:
        """Queue a request; return its stream once the engine accepted it.

        ``options``: priority and prefix-cache controls (``RequestOptions``).

        Raises ``QueueFullError``, ``DrainingError`` or ``EngineDeadError`` at once,
        and the engine's ``ValueError`` (bad prompt or parameters) after it looked.
        """
        if params.structured_outputs is not None:  # a compile error is a ValueError now
            await self._precompile(params)
        self._admit()
        rid = request_id or uuid.uuid4().hex
        stream = RequestStream(rid, self, asyncio.get_running_loop(), params.output_kind)
        self._commands.put(_Add(stream, list(prompt_token_ids), params, prompt, options))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(rid)
            raise
        return stream

    async def _precompile(self, params: SamplingParams) -> None:
        """Compile the request's grammar before queueing it (limits checked first); raises
        the compile's InvalidRequestError, or a timeout past the limits' compile_timeout."""
        structured = self.engine.structured
        assert params.structured_outputs is not None
        future = structured.precompile(params.structured_outputs)
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), structured.limits.compile_timeout
            )
        except asyncio.TimeoutError as e:
            raise structured.compile_timeout_error() from e

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one prompt as they come (per ``sampling_params.output_kind``).

        Leaving the ``async for`` early (or cancelling the task) aborts the request.
        """
        [(text, token_ids)] = normalize_prompts(prompt, self.tokenizer)[:1]
        params = sampling_params or SamplingParams()
        stream = await self.add_request(token_ids, params, request_id, prompt=text)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached KV block; returns how many were dropped."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe); its blocks are free before the next step."""
        self._commands.put(_Abort(request_id))

    def _admit(self) -> None:
        admit(self)

    # -- lifecycle ----------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """Start draining: new requests get ``DrainingError``; accepted ones go on."""
        with self._lock:
            self._accepting = False

    async def drain(self, timeout: float | None = None, poll: float = 0.05) -> bool:
        """Stop accepting, then wait until every accepted request finished.

        Returns False if ``timeout`` seconds passed first.
        """
        self.stop_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._num_live > 0 and self._thread.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll)
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and give the engine back."""
        self.stop_accepting()
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------
    def _turn(self) -> contextlib.AbstractContextManager[None]:
        """One turn of the engine thread's loop holds the engine (``engine/drive.py``)."""
        drive = getattr(self.engine, "drive", None)
        return contextlib.nullcontext() if drive is None else drive.turn()

    def _run(self) -> None:
        drive = getattr(self.engine, "drive", None)
        if drive is not None:
            drive.served = True  # an offline run on this engine waits for it to be idle
        try:
            while True:
                first = self._next_command(block=not self.engine.has_unfinished())
                with self._turn():
                    if self._handle_commands(first):
                        break
                    self._expire_queued()
                    if self.engine.has_unfinished():
                        self._route(self.engine.step())
                    self._mark_started()
                self._flush()
        except BaseException as exc:  # a bug, not a bad request: fail everyone, stay dead
            logger.exception("the engine thread failed")
            self._dead = exc
            for rid in list(self._live):
                self._release(rid, EngineDeadError(f"the engine failed: {exc!r}"))
        finally:
            with self._turn():
                for rid in list(self._live):
                    self.engine.abort(rid)
                    self._release(rid, EngineDeadError("the engine was shut down"))
            if drive is not None:
                drive.served = False
            self._flush()

    def _next_command(self, block: bool) -> object | None:
        """The first queued command (waiting for one when idle, holding nothing)."""
        try:
            return self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return None

    def _handle_commands(self, cmd: object | None) -> bool:
        """Apply ``cmd`` and the commands queued behind it; True on stop."""
        if cmd is None:
            return False
        while True:
            if isinstance(cmd, _Stop):
                return True
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _Call):
                _run_call(cmd, self.engine)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False

    def _add(self, cmd: _Add) -> None:
        stream = cmd.stream
        try:
            self.engine.add_request(
                cmd.prompt_token_ids, cmd.params, stream.request_id, cmd.prompt, cmd.options
            )
        except Exception as exc:  # bad input: the caller gets the ValueError
            self._done(started=False)
            self._send(stream, exc)
            return
        self._live[stream.request_id] = _Live(stream, stream.arrival)
        self._send(stream, ACCEPTED)

    def _abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        out = self.engine.abort(request_id)
        self._release(request_id, out)

    def _expire_queued(self) -> None:
        if self.queue_timeout is None:
            return
        now = time.monotonic()
        for rid, live in list(self._live.items()):
            if live.started or now - live.arrival <= self.queue_timeout:
                continue
            self.engine.mark_timed_out(rid)
            self.engine.abort(rid)
            self._release(
                rid,
                QueueTimeoutError(
                    f"the request waited {now - live.arrival:.1f}s to start "
                    f"(queue_timeout={self.queue_timeout}s); the server is overloaded, retry later"
                ),
            )

    def _mark_started(self) -> None:
        for rid, live in self._live.items():
            if not live.started and self.engine.is_started(rid):
                live.started = True
                with self._lock:
                    self._num_queued -= 1

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if out.finished:
                self._release(out.request_id, out)
            else:
                self._send(live.stream, out)

    def _release(self, request_id: str, last: object) -> None:
        """The request is over: send its last item and drop it from the counts."""
        live = self._live.pop(request_id)
        self._done(started=live.started)
        if last is not None:
            self._send(live.stream, last)

    def _done(self, started: bool) -> None:
        with self._lock:
            self._num_live -= 1
            if not started:
                self._num_queued -= 1

    def _send(self, stream: RequestStream, item: object) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream, item))

    def _flush(self) -> None:
        for loop, items in self._outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                for stream, _ in items:
                    self._commands.put(_Abort(stream.request_id))
        self._outbox.clear()


def _run_call(cmd: _Call, engine: LLMEngine) -> None:
    try:
        cmd.future.set_result(cmd.fn(engine))
    except Exception as exc:  # the caller gets it
        cmd.future.set_exception(exc)


def _deliver(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.put(item)


def admit(front: Any) -> None:
    """Count one more queued request on an async front end (``AsyncLLM`` or the pooling
    one: the same ``_dead``, ``_thread``, ``_lock``, ``_accepting``, ``_num_queued``,
    ``_num_live``, ``max_queued_requests`` and ``stats``), or raise why it is refused."""
    if front._dead is not None or not front._thread.is_alive():
        raise EngineDeadError(f"the engine stopped: {front._dead or 'shut down'}")
    with front._lock:
        if not front._accepting:
            front.stats.refused_draining += 1
            raise DrainingError("the server is shutting down; send the request elsewhere")
        limit = front.max_queued_requests
        if limit is not None and front._num_queued >= limit:
            front.stats.refused_queue_full += 1
            raise QueueFullError(
                f"{front._num_queued} requests are waiting (max_queued_requests={limit}); "
                "retry later"
            )
        front._num_queued += 1
        front._num_live += 1
