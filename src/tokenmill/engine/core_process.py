"""``EngineCoreClient``: ``AsyncLLM``'s interface with the engine in its own process.

The engine-core layout of vLLM and SGLang: the server process keeps HTTP, tokenization,
admission and the per-request streams; a child process (``engine_core.py``, started with
``spawn``) owns the ``LLMEngine`` and steps it. The client is an ``AsyncLLM`` whose
command queue is the pipe to the child and whose "engine thread" is the thread that reads
the child's messages: one per engine step, dispatched to the streams' event loops with
``AsyncLLM``'s own hand-off (one wake-up per loop per step). Admission control, draining,
``generate`` and the streams are ``AsyncLLM``'s, unchanged.

What the server reads of the engine (``engine.max_model_len``, the tokenizer, the
structured-output manager for grammar precompiles, ``engine.kv.usage``, the stats behind
``/metrics``) is an ``EngineView`` in this process: fixed facts from start-up, counters
from the child's latest snapshot (sent with every step in which a request starts or ends,
and at least every ``STATS_INTERVAL_S`` while requests run).

``call(fn)`` pickles ``fn``: it must be importable (a module-level function, or a method
such as ``LLMEngine.reset_prefix_cache``), not a lambda. If the child dies, every live
request fails with ``EngineDeadError`` naming its exit code, and the client stays dead.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, _Abort, _Add, _Call, _Stop
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.engine_core import (
    AbortCmd,
    AddCmd,
    CallCmd,
    CallResult,
    CoreOptions,
    Exited,
    LoadFailed,
    Ready,
    Snapshot,
    StepOutputs,
    StopCmd,
    dump_stacks,
    dumps,
    run_engine_core,
)
from tokenmill.engine.request_stream import ACCEPTED, RequestStream
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.metrics.stats import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.structured_output.limits import GrammarLimits
from tokenmill.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Checkpoint:
    generation_config: dict


@dataclass(frozen=True)
class _Loaded:
    checkpoint: _Checkpoint


@dataclass
class KVView:
    """The child's KV cache as of its latest snapshot."""

    num_blocks: int
    num_free_blocks: int
    usage: float = 0.0


class EngineView:
    """The parts of ``LLMEngine`` the server reads, mirrored in the server process."""

    def __init__(
        self, config: EngineConfig, ready: Ready, structured: StructuredOutputManager
    ) -> None:
        self.config = config
        self.tokenizer = ready.tokenizer
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.structured = structured
        """The server's own grammar compiler (precompiles: a bad grammar is a 400 here)."""
        self.loaded = _Loaded(_Checkpoint(ready.generation_config))
        self.kv = KVView(ready.num_kv_blocks, ready.num_kv_blocks)
        self.stats = EngineStats()
        """The child's counters, plus the server's refusals (``SERVER_STATS``)."""
        self._prefix_cache: dict[str, int | float] = {}
        if ready.media:  # else no attribute: the server refuses media (``chat_media_of``)
            self.mm_processor = (
                None if ready.mm_processor is None else pickle.loads(ready.mm_processor)
            )
            """The child's media processor: media become tensors here, before ``AddCmd``."""
        self._encoder: dict[str, float | int] = {}

    def prefix_cache_metrics(self) -> dict[str, int | float]:
        return dict(self._prefix_cache)

    def encoder_metrics(self) -> dict[str, float | int]:
        """The child's encoder counters as of its latest snapshot (``multimodal_metrics``)."""
        return dict(self._encoder)

    def update(self, snap: Snapshot) -> None:
        """Called by the reader thread, the only writer of these fields."""
        for name, value in snap.stats.items():
            setattr(self.stats, name, value)
        self.kv.usage, self.kv.num_free_blocks = snap.kv_usage, snap.num_free_blocks
        self._prefix_cache = snap.prefix_cache
        self._encoder = snap.multimodal


class _Forward:
    """Stands in for ``AsyncLLM``'s command queue: ``put`` sends to the engine process."""

    def __init__(self, put: Callable[[object], None]) -> None:
        self.put = put


@dataclass(frozen=True)
class _Open:
    """A request in the engine process: its stream, and the prompt its outputs lack."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class _Pending:
    """What the reader thread resolves: open requests by id, calls by id."""

    streams: dict[str, _Open] = field(default_factory=dict)
    calls: dict[int, Any] = field(default_factory=dict)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EngineCoreClient(AsyncLLM):
    """``AsyncLLM`` over an engine in a child process; ``shutdown`` ends the process."""

    def __init__(
        self,
        config: EngineConfig,
        max_queued_requests: int | None = None,
        queue_timeout: float | None = None,
        grammar_limits: GrammarLimits | None = None,
        load_timeout: float | None = None,
    ) -> None:
        """Blocks until the child loaded the model; raises its load error (the same type)."""
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        options = CoreOptions(
            queue_timeout, grammar_limits, logging.getLogger().getEffectiveLevel()
        )
        self.process = ctx.Process(
            target=run_engine_core,
            name="tokenmill-engine-core",
            args=(config, options, cmd_recv, out_send),
            daemon=True,
        )
        self.process.start()
        self._shutdown_lock = threading.Lock()
        cmd_recv.close()
        out_send.close()
        self._write_lock = threading.Lock()
        self._pending = _Pending()
        self._ids = itertools.count()
        self._core_counts = (0, 0)
        try:
            ready = self._wait_ready(load_timeout)
        except BaseException:
            self._stop_process(5.0)
            raise
        structured = StructuredOutputManager.from_config(config, ready.tokenizer, ready.vocab_size)
        if grammar_limits is not None:
            structured.set_limits(grammar_limits)
        view = EngineView(config, ready, structured)
        super().__init__(cast(LLMEngine, view), max_queued_requests, queue_timeout)

    def _start(self) -> threading.Thread:
        self._commands = _Forward(self._forward)  # type: ignore[assignment]
        reader = threading.Thread(target=self._read, name="tokenmill-core-reader", daemon=True)
        reader.start()
        return reader

    def _wait_ready(self, timeout: float | None) -> Ready:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._out_recv.poll(0.2):
            if not self.process.is_alive():
                raise EngineDeadError(
                    f"the engine process exited with code {self.process.exitcode} while loading"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not load within {timeout}s")
        msg = pickle.loads(self._out_recv.recv_bytes())
        if isinstance(msg, LoadFailed):
            raise msg.error
        assert isinstance(msg, Ready), msg
        return msg

    # -- requests ---------------------------------------------------------------------
    async def reset_prefix_cache(self) -> int:
        return await self.call(LLMEngine.reset_prefix_cache)

    def _forward(self, cmd: object) -> None:
        """AsyncLLM's commands -> messages to the engine process (any thread)."""
        if isinstance(cmd, _Add):
            self._forward_add(cmd)
        elif isinstance(cmd, _Abort):
            self._write(dumps(AbortCmd(cmd.request_id)))
        elif isinstance(cmd, _Call):
            try:
                fn = dumps(cmd.fn)
            except Exception as exc:  # noqa: BLE001 - a lambda or closure
                cmd.future.set_exception(
                    TypeError(
                        f"call() sends its function to the engine process, so it must be "
                        f"picklable (a module-level function), got {cmd.fn!r}: {exc}"
                    )
                )
                return
            call_id = next(self._ids)
            with self._pending.lock:
                if self._pending.closed:
                    cmd.future.set_exception(EngineDeadError("the engine process has exited"))
                    return
                self._pending.calls[call_id] = cmd.future
            self._write(dumps(CallCmd(call_id, fn)))
        elif isinstance(cmd, _Stop):
            self._write(dumps(StopCmd()))

    def _forward_add(self, cmd: _Add) -> None:
        """On the stream's event loop (``add_request``): a refusal goes to the stream."""
        stream = cmd.stream
        try:
            blob = dumps(
                AddCmd(
                    stream.request_id,
                    stream.arrival,
                    cmd.prompt_token_ids,
                    cmd.params,
                    cmd.prompt,
                    cmd.options,
                )
            )
        except Exception as exc:  # noqa: BLE001 - e.g. a per-request logits processor
            self._done(started=False)
            stream.put(
                InvalidRequestError(
                    f"the request can not be sent to the engine process ({exc}); per-request "
                    "Python objects such as logits_processors need --engine-process off"
                )
            )
            return
        with self._pending.lock:
            closed = self._pending.closed
            if not closed:
                self._pending.streams[stream.request_id] = _Open(
                    stream, cmd.prompt, cmd.prompt_token_ids
                )
        if closed:
            self._done(started=False)
            stream.put(self._dead or EngineDeadError("the engine process has exited"))
            return
        self._write(blob)

    def _write(self, blob: bytes) -> None:
        try:
            with self._write_lock:
                self._cmd_send.send_bytes(blob)
        except OSError:  # the process is gone: the reader fails what is pending
            pass

    # -- the reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        error: EngineDeadError | None = None
        try:
            while True:
                msg = pickle.loads(self._out_recv.recv_bytes())
                if isinstance(msg, StepOutputs):
                    self._on_outputs(msg)
                elif isinstance(msg, CallResult):
                    self._on_result(msg)
                elif isinstance(msg, Exited):
                    if msg.error is not None:
                        error = EngineDeadError(msg.error)
                    break
        except (EOFError, OSError):
            self.process.join(2.0)
            error = EngineDeadError(f"the engine process died (exit code {self.process.exitcode})")
        except BaseException as exc:  # a bug here: fail everyone, stay dead
            logger.exception("reading the engine process failed")
            error = EngineDeadError(f"reading the engine process failed: {exc!r}")
        if error is not None:
            logger.error("%s", error)
            self._dead = error
        self._fail_pending(error or EngineDeadError("the engine was shut down"))

    def _on_outputs(self, msg: StepOutputs) -> None:
        streams = self._pending.streams
        for rid, item in msg.items:
            request = streams.get(rid)
            if request is None:
                continue
            if item is None:
                item = ACCEPTED
            elif isinstance(item, RequestOutput):
                item.prompt, item.prompt_token_ids = request.prompt, request.prompt_token_ids
            if isinstance(item, BaseException) or getattr(item, "finished", False):
                with self._pending.lock:
                    streams.pop(rid, None)
            self._send(request.stream, item)
        queued, live = self._core_counts
        with self._lock:
            self._num_queued += msg.num_queued - queued
            self._num_live += msg.num_live - live
        self._core_counts = (msg.num_queued, msg.num_live)
        if msg.snapshot is not None:
            cast(EngineView, self.engine).update(msg.snapshot)
        self._flush()

    def _on_result(self, msg: CallResult) -> None:
        with self._pending.lock:
            future = self._pending.calls.pop(msg.call_id, None)
        if future is not None:
            _settle(future, msg.value, msg.error)

    def _fail_pending(self, error: BaseException) -> None:
        """The process ended: every request and call still open fails with ``error``."""
        with self._pending.lock:
            self._pending.closed = True
            streams, self._pending.streams = self._pending.streams, {}
            calls, self._pending.calls = self._pending.calls, {}
        for request in streams.values():
            self._send(request.stream, error)
        with self._lock:
            self._num_queued = self._num_live = 0
        for future in calls.values():
            _settle(future, None, error)
        self._flush()

    # -- lifecycle ----------------------------------------------------------------------
    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the engine process and wait for it (killed past
        ``timeout``). Any thread, any number of times: the server's lifespan and its
        ``close()`` both call it, and a second caller waits for the first."""
        with self._shutdown_lock:
            super().shutdown(timeout)
            self._stop_process(timeout)

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning(
                "the engine process did not stop within %gs: its threads' stacks follow on "
                "stderr, then it is killed",
                timeout,
            )
            dump_stacks(self.process)
            self.process.kill()
            self.process.join(5.0)
        for conn in (self._cmd_send, self._out_recv):
            conn.close()


def _settle(future: concurrent.futures.Future, value: object, error: BaseException | None) -> None:
    """Complete a ``call()``'s future, unless its caller gave up (cancelled it) meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


def use_engine_process(mode: str, config: EngineConfig) -> bool:
    """``ServerConfig.engine_process`` decided: on, off, or auto = off (measured on a
    2-core CPU machine with 8 and 32 streaming clients: docs/architecture.md)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"engine_process must be auto, on or off, got {mode!r}")
    return mode == "on"
