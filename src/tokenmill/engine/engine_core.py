"""The engine-core process: an ``LLMEngine`` behind two pipes, and the messages they carry.

``EngineCoreClient`` (``core_process.py``, in the server process) spawns
``run_engine_core`` in a child process. The child runs the same loop as the thread mode:
an ``AsyncLLM`` engine thread (``EngineCore``) that steps while there is work; only its
per-step hand-off differs. Where ``AsyncLLM`` wakes each event loop once per step, the
core writes one ``StepOutputs`` message per step to the output pipe, batching every
request's outputs. A second thread of the child reads the command pipe into the engine
thread's command queue.

Messages are small pickled dataclasses. Server -> core: ``AddCmd``, ``AbortCmd``,
``CallCmd``, ``StopCmd``. Core -> server: ``Ready`` (or ``LoadFailed``) once, then
``StepOutputs`` and ``CallResult``, and ``Exited`` last.

Admission (``max_queued_requests``, draining) stays in the server process; the core only
reports how its counts moved (``StepOutputs.num_queued``/``num_live``: the core never
admits, so they start at 0 and only fall; the server applies the differences). The
``queue_timeout`` is applied here, where the engine sees when a request starts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import faulthandler
import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM, _Abort, _Add, _Call, _Stop
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import RequestOptions
from tokenmill.engine.request_stream import ACCEPTED
from tokenmill.metrics.stats import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.limits import GrammarLimits

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1
"""Longest time between two stats snapshots while requests run (one also goes with every
message in which a request starts or ends, so a finished request's counters are exact)."""

SERVER_STATS = frozenset({"refused_queue_full", "refused_draining"})
"""``EngineStats`` fields that the server process writes (its admission); the core's
snapshots carry all the others."""


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# -- server -> core ----------------------------------------------------------------------
@dataclass(frozen=True)
class CoreOptions:
    queue_timeout: float | None = None
    grammar_limits: GrammarLimits | None = None
    log_level: int = logging.WARNING


@dataclass(frozen=True)
class AddCmd:
    request_id: str
    arrival: float
    """``time.monotonic()`` in the server process (the clock is the machine's)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    options: RequestOptions | None


@dataclass(frozen=True)
class AbortCmd:
    request_id: str


@dataclass(frozen=True)
class CallCmd:
    call_id: int
    fn: bytes
    """The pickled function (unpickled in the core, so a failure comes back as its result)."""


@dataclass(frozen=True)
class StopCmd:
    pass


# -- core -> server ----------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """What the server needs of the loaded engine, sent once."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    generation_config: dict
    num_kv_blocks: int
    mm_processor: bytes | None = None
    """The engine's media processor (``multimodal/``), pickled (``EngineView`` loads it): the
    server process turns a request's media into placeholder runs and pixel / feature
    tensors itself, which travel in ``AddCmd.options``; None for a text-only model."""
    media: bool = True
    """False when the processor could not be pickled: the server refuses media."""


def ready_of(engine: LLMEngine) -> Ready:
    """The ``Ready`` message of a loaded engine (the engine-core process, a Ray replica)."""
    processor, media = None, True
    if engine.mm_processor is not None:
        try:
            processor = dumps(engine.mm_processor)
        except Exception as exc:  # noqa: BLE001 - the server then refuses media, serves text
            logger.warning(
                "media input is off in this mode: its processor does not pickle (%s)", exc
            )
            media = False
    return Ready(
        engine.tokenizer,
        engine.max_model_len,
        engine.vocab_size,
        engine.loaded.checkpoint.generation_config,
        engine.kv.num_blocks,
        processor,
        media,
    )


@dataclass(frozen=True)
class LoadFailed:
    error: BaseException


@dataclass(frozen=True)
class Snapshot:
    """The engine's counters after a step (``EngineStats`` without the server's fields)."""

    stats: dict[str, Any]
    kv_usage: float
    num_free_blocks: int
    prefix_cache: dict[str, int | float]
    multimodal: dict[str, float | int] = field(default_factory=dict)
    """The encoder's counters (``multimodal_metrics`` without the processor's, which the
    server process keeps)."""


@dataclass(frozen=True)
class StepOutputs:
    items: list[tuple[str, object]]
    """(request id, item): a ``RequestOutput`` without its prompt (``prompt`` None,
    ``prompt_token_ids`` empty: the server has them), an exception that ends the request,
    or None: the engine accepted the request."""
    num_queued: int
    num_live: int
    snapshot: Snapshot | None = None


@dataclass(frozen=True)
class CallResult:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class Exited:
    error: str | None = None
    """Why the engine stopped when it failed; None after a ``StopCmd``."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else the nearest builtin with its message (input
    errors stay ValueErrors: the server answers them with 400)."""
    try:
        pickle.loads(dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        return kind(f"{type(exc).__name__}: {exc}")


@dataclass
class _Remote:
    """A stream that lives in the server process: what the engine thread needs of it."""

    request_id: str
    arrival: float
    loop: None = None  # one "loop": the pipe


@dataclass
class _Sent:
    counts: tuple[int, int] = (0, 0)
    snapshot_at: float = 0.0
    names: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            f.name
            for f in fields(EngineStats)
            if not f.name.startswith("_") and f.name not in SERVER_STATS
        )
    )


class EngineCore(AsyncLLM):
    """``AsyncLLM``'s engine thread with its streams in the server process: each step's
    hand-off (``_flush``) is one ``StepOutputs`` message on the output pipe."""

    def __init__(self, engine: LLMEngine, queue_timeout: float | None, out: Connection) -> None:
        self._out = out
        self._write_lock = threading.Lock()
        self._sent = _Sent()
        super().__init__(engine, None, queue_timeout)

    def write(self, message: object) -> None:
        """Send one message (any thread); a closed pipe means the server is gone: stop."""
        blob = dumps(message)
        try:
            with self._write_lock:
                self._out.send_bytes(blob)
        except OSError:
            self._commands.put(_Stop())

    def _flush(self) -> None:
        counts = (self._num_queued, self._num_live)
        if not self._outbox and counts == self._sent.counts:
            return
        items = [
            (stream.request_id, None if item is ACCEPTED else _wire(item))
            for group in self._outbox.values()
            for stream, item in group
        ]
        self._outbox.clear()
        now = time.monotonic()
        snapshot = None
        if counts != self._sent.counts or now - self._sent.snapshot_at >= STATS_INTERVAL_S:
            snapshot = self._snapshot()
            self._sent.snapshot_at = now
        self._sent.counts = counts
        self.write(StepOutputs(items, counts[0], counts[1], snapshot))

    def _snapshot(self) -> Snapshot:
        engine = self.engine
        stats = {name: getattr(engine.stats, name) for name in self._sent.names}
        return Snapshot(
            stats,
            engine.kv.usage,
            engine.kv.num_free_blocks,
            engine.prefix_cache_metrics(),
            engine.encoder_metrics(),
        )

    # -- the command pipe (the core's second thread) ----------------------------------
    def read_commands(self, conn: Connection) -> None:
        try:
            while True:
                cmd = pickle.loads(conn.recv_bytes())
                if isinstance(cmd, AddCmd):
                    self._commands.put(
                        _Add(
                            _Remote(cmd.request_id, cmd.arrival),  # type: ignore[arg-type]
                            cmd.prompt_token_ids,
                            cmd.params,
                            cmd.prompt,
                            cmd.options,
                        )
                    )
                elif isinstance(cmd, AbortCmd):
                    self._commands.put(_Abort(cmd.request_id))
                elif isinstance(cmd, CallCmd):
                    self._call(cmd)
                elif isinstance(cmd, StopCmd):
                    self._commands.put(_Stop())
                    return
        except (EOFError, OSError):  # the server process is gone
            self._commands.put(_Stop())

    def _call(self, cmd: CallCmd) -> None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(lambda f: self._reply(cmd.call_id, f))
        try:
            fn = pickle.loads(cmd.fn)
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            future.set_exception(exc)
            return
        self._commands.put(_Call(fn, future))

    def _reply(self, call_id: int, future: concurrent.futures.Future) -> None:
        error = future.exception()
        result = (
            CallResult(call_id, error=portable(error))
            if error
            else CallResult(call_id, future.result())
        )
        try:
            dumps(result)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            result = CallResult(
                call_id,
                error=TypeError(f"the result of the call can not leave the engine process: {exc}"),
            )
        self.write(result)


def _wire(item: object) -> object:
    """An item as it crosses the pipe: outputs leave their prompt behind (every delta
    would carry it again), exceptions are made portable."""
    if isinstance(item, RequestOutput):
        return dataclasses.replace(item, prompt=None, prompt_token_ids=[])
    return portable(item) if isinstance(item, BaseException) else item


STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks(process: BaseProcess, wait: float = 1.0) -> None:
    """Have a live engine process write every thread's stack to its stderr (before a kill:
    the log then says where it hung)."""
    if process.pid is None or not process.is_alive():
        return
    try:
        os.kill(process.pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return
    time.sleep(wait)


def run_engine_core(
    config: EngineConfig, options: CoreOptions, commands: Connection, out: Connection
) -> None:
    """The child process's main: load, say ``Ready``, serve until ``StopCmd``, say ``Exited``.

    Exit code 0 after a stop, 1 when loading or the engine failed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it drains, then stops us
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # dump_stacks: why a stop hangs
    logging.basicConfig(
        level=options.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s",
    )
    try:
        engine = LLMEngine(config)
        if options.grammar_limits is not None:
            engine.structured.set_limits(options.grammar_limits)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which raises it
        out.send_bytes(dumps(LoadFailed(portable(exc))))
        sys.exit(1)
    core = EngineCore(engine, options.queue_timeout, out)
    core.write(ready_of(engine))
    threading.Thread(
        target=core.read_commands, args=(commands,), name="tokenmill-core-commands", daemon=True
    ).start()
    core._thread.join()
    error = None if core._dead is None else f"the engine failed: {core._dead!r}"
    core.write(Exited(error))
    out.close()
    if error is not None:
        sys.exit(1)
