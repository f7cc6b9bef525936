"""One data-parallel replica: an engine in a Ray actor, reached like the engine process.

The actor (``ReplicaActor``) loads an ``LLMEngine`` and serves it with the engine-core
loop of ``engine_core.py`` (``EngineCore``: one ``StepOutputs`` message per step) over a
``multiprocessing.connection`` socket it listens on, so the server side is
``EngineCoreClient`` unchanged but for how it starts and watches its engine
(``ReplicaClient``). Ray places and restarts the actors; the socket carries the steps.
Ray itself is imported only here and in ``router.py``, when a replica starts.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener
from typing import Any, cast

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.core_process import EngineCoreClient, EngineView, _Pending
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.engine_core import (
    CoreOptions,
    EngineCore,
    Exited,
    LoadFailed,
    portable,
    ready_of,
)
from tokenmill.errors import EngineDeadError
from tokenmill.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class ReplicaActor:
    """The Ray actor's class (``ray.remote`` is applied by ``actor_class``)."""

    def __init__(self, config: EngineConfig, options: CoreOptions) -> None:
        logging.basicConfig(level=options.log_level)
        self.options = options
        self.error: BaseException | None = None
        try:
            self.engine: LLMEngine | None = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - reported to the client, which raises it
            self.engine, self.error = None, portable(exc)
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener((_host(), 0), authkey=self.authkey)

    def address(self) -> tuple[Any, bytes, int]:
        """(socket address, its key, this process's pid)."""
        return self.listener.address, self.authkey, os.getpid()

    def serve(self) -> None:
        """Accept the client, say ``Ready`` (or ``LoadFailed``), run the engine loop in
        this process's threads; returns at once (the actor stays free for calls)."""
        conn = self.listener.accept()
        if self.engine is None:
            assert self.error is not None
            conn.send_bytes(_dumps(LoadFailed(self.error)))
            return
        engine = self.engine
        if self.options.grammar_limits is not None:
            engine.structured.set_limits(self.options.grammar_limits)
        core = EngineCore(engine, self.options.queue_timeout, conn)
        core.write(ready_of(engine))
        threading.Thread(target=core.read_commands, args=(conn,), daemon=True).start()
        threading.Thread(target=_say_exited, args=(core, conn), daemon=True).start()

    def pid(self) -> int:
        return os.getpid()


def _say_exited(core: EngineCore, conn: Any) -> None:
    """After the engine loop ends (a ``StopCmd``): ``Exited``, as ``run_engine_core`` says."""
    core._thread.join()
    error = None if core._dead is None else f"the engine failed: {core._dead!r}"
    core.write(Exited(error))
    conn.close()


def actor_class(num_cpus: float) -> Any:
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=0)(ReplicaActor)


class _ActorProcess:
    """What ``EngineCoreClient`` asks of its engine process, for a Ray actor."""

    def __init__(self, actor: Any, pid: int, index: int) -> None:
        self.actor, self.pid, self.index = actor, pid, index
        self.exitcode: int | None = None
        self._gone = threading.Event()

    def is_alive(self) -> bool:
        return not self._gone.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._gone.wait(0 if timeout is None else min(timeout, 0.1))

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        self._gone.set()


class ReplicaClient(EngineCoreClient):
    """``EngineCoreClient`` over a replica actor. ``on_item(stream, item)`` sees every
    item before it goes to a request's stream and may take it (returns False): the router
    counts and retries through it."""

    def __init__(
        self,
        index: int,
        actor: Any,
        config: EngineConfig,
        options: CoreOptions,
        on_item: Callable[[Any, object], bool],
        max_queued_requests: int | None = None,
    ) -> None:
        import ray

        self.index, self.on_item = index, on_item
        address, key, pid = ray.get(actor.address.remote())
        self.process = _ActorProcess(actor, pid, index)  # type: ignore[assignment]
        actor.serve.remote()
        conn = Client(address, authkey=key)
        self._cmd_send = self._out_recv = conn
        self._write_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()  # EngineCoreClient.shutdown
        self._pending = _Pending()
        self._ids = itertools.count()
        self._core_counts = (0, 0)
        try:
            ready = self._wait_ready(None)
        except BaseException:
            self.process.kill()
            raise
        structured = StructuredOutputManager.from_config(config, ready.tokenizer, ready.vocab_size)
        if options.grammar_limits is not None:
            structured.set_limits(options.grammar_limits)
        view = EngineView(config, ready, structured)
        AsyncLLM.__init__(self, cast(LLMEngine, view), max_queued_requests, options.queue_timeout)

    def _send(self, stream, item) -> None:
        if self.on_item(stream, item):
            super()._send(stream, item)

    def _read(self) -> None:
        super()._read()
        self.process._gone.set()  # type: ignore[attr-defined]

    def _fail_pending(self, error: BaseException) -> None:
        if isinstance(error, EngineDeadError) and "died" in str(error):
            error = EngineDeadError(
                f"data-parallel replica {self.index} (pid {self.process.pid}) died; "
                "its requests that had produced output fail, the others are retried"
            )
        super()._fail_pending(error)

    def _stop_process(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.process.is_alive():
            self.process.kill()
        self._cmd_send.close()


def _host() -> str:
    """The address other nodes reach this one at (loopback on a one-node cluster)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not under Ray (tests of the class itself)
        return socket.gethostbyname("localhost")


def _dumps(obj: object) -> bytes:
    from tokenmill.engine.engine_core import dumps

    return dumps(obj)
