"""``OpenAIServer``: the app on uvicorn, in the foreground (``tokenmill serve``,
``LLM.serve``) or in a background thread (tests, benchmarks).

Shutdown drains: the first SIGTERM/SIGINT (or ``close()``) stops accepting (new
requests get 503, ``/health`` says 503), lets every accepted request finish (for at
most ``shutdown_timeout`` seconds), then stops uvicorn; a second signal, or a drain
that runs out of time, aborts what is left (open streams get an error event) and
``run()`` returns exit code 1.

Connections: idle keep-alive connections close after ``timeout_keep_alive``, a
client that does not send its headers within ``timeout_headers`` is cut
(``connections.py``), and past ``limit_concurrency`` connections + requests new
requests get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.engine import LLMEngine
from tokenmill.entrypoints.openai.connections import with_header_timeout
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.entrypoints.openai.state import ServerConfig, ServerState, model_name_of
from tokenmill.pooling.engine import PoolingEngine
from tokenmill.pooling.frontend import AsyncPoolingLLM

logger = logging.getLogger(__name__)

FORCED_EXIT_FLUSH_S = 0.5
"""Seconds a forced exit gives the cut streams to send their error event."""

EngineSource = (
    LLMEngine
    | PoolingEngine
    | EngineConfig
    | Callable[[], LLMEngine | PoolingEngine | EngineConfig]
)
"""A loaded engine, or what to load (the server answers 503 meanwhile): an ``EngineConfig``
is loaded in a thread, or in the engine process (``ServerConfig.engine_process``)."""


class OpenAIServer:
    def __init__(
        self,
        engine: EngineSource,
        config: ServerConfig | None = None,
        model_name: str | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        if isinstance(engine, LLMEngine) and self.config.engine_process == "on":
            raise ValueError(
                "engine_process='on' loads the engine in its own process: pass "
                "an EngineConfig, not a loaded engine"
            )
        if model_name is None:
            if not isinstance(engine, LLMEngine | PoolingEngine | EngineConfig):
                raise ValueError("pass model_name when the engine is loaded by the server")
            econf = engine if isinstance(engine, EngineConfig) else engine.config
            model_name = model_name_of(econf.model, econf.served_model_name)
        self.state = ServerState(self.config, model_name)
        self._source = engine
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.app = build_app(self.state, on_startup=self._on_startup, on_shutdown=self._stop_engine)
        self._socket = _bind(self.config.host, self.config.port)
        self.exit_code = 0
        """1 once the server was forced to stop (a second signal, or a drain past its time)."""
        lim = self.config.limits
        self.port: int = self._socket.getsockname()[1]
        uv_level = self.config.uvicorn_log_level or self.config.log_level
        uv_config = uvicorn.Config(
            self.app,
            log_level=uv_level,
            lifespan="on",
            timeout_keep_alive=lim.timeout_keep_alive,
            limit_concurrency=lim.limit_concurrency,
            http=with_header_timeout(lim.timeout_headers),
        )
        self._uv = _Uvicorn(uv_config, self)

    @property
    def url(self) -> str:
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    # -- foreground -------------------------------------------------------------------
    def run(self) -> int:
        """Serve until a signal or ``close()``; returns after the drain. Blocking.

        Returns the exit code: 0 after a full drain, 1 when requests were cut."""
        try:
            self._uv.run(sockets=[self._socket])
        finally:
            self._stop_engine()
            self._socket.close()
        if self._error is not None:
            raise self._error
        return self.exit_code

    # -- background ---------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> OpenAIServer:
        """Serve from a background thread; returns once the socket accepts connections."""
        self._thread = threading.Thread(
            target=self._run_quietly, name="tokenmill-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self._error or 'timeout'}")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the model is loaded (raises its load error, or on timeout)."""
        deadline = time.monotonic() + timeout
        while not self.state.ready:
            if self._error is not None:
                raise self._error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the model did not load within {timeout}s")
            time.sleep(0.05)

    def close(self, timeout: float | None = None) -> None:
        """Drain (finish accepted requests, refuse new ones), then stop. Idempotent."""
        loop = self._loop
        if loop is not None and loop.is_running():
            drained = asyncio.run_coroutine_threadsafe(self.drain_and_exit(), loop)
            with contextlib.suppress(Exception):
                drained.result(timeout)
        self._uv.should_exit = True
        self._stop_engine()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run_quietly(self) -> None:
        with contextlib.suppress(BaseException):
            self.run()

    # -- lifecycle hooks ------------------------------------------------------------------
    def _on_startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        source = self._source
        if isinstance(source, LLMEngine | PoolingEngine):
            self._attach(source)
        else:
            factory = source if callable(source) else lambda: source
            threading.Thread(
                target=self._load, args=(factory,), name="tokenmill-load", daemon=True
            ).start()

    def _load(self, factory: Callable[[], LLMEngine | PoolingEngine | EngineConfig]) -> None:
        try:
            self._attach(factory())
        except BaseException as exc:  # noqa: BLE001 - reported by run() / wait_ready()
            logger.error("loading the model failed: %s", exc)
            self._error = exc
            self.state.load_error = exc
            self._uv.should_exit = True

    def _attach(self, engine: LLMEngine | PoolingEngine | EngineConfig) -> None:
        cfg = self.config
        if isinstance(engine, EngineConfig):
            from tokenmill.pooling.task import plan_pooling

            plan = plan_pooling(engine)  # an embedding / scoring model (pooling/)
            engine = engine if plan is None else PoolingEngine(engine, plan)
        if isinstance(engine, PoolingEngine):
            if cfg.engine_process == "on":  # said, not silently ignored
                logger.warning(
                    "engine_process='on' applies to generation models only: the pooling model "
                    "runs on its engine thread in the server process"
                )
            self.state.llm = AsyncPoolingLLM(engine, cfg.max_queued_requests, cfg.queue_timeout)
            self._log_serving()
            return
        if isinstance(engine, EngineConfig) and engine.parallel.data_parallel_size > 1:
            from tokenmill.distributed.router import DataParallelRouter

            self.state.llm = DataParallelRouter(
                engine, cfg.max_queued_requests, cfg.queue_timeout, cfg.limits.grammar
            )
            self._log_serving()
            return
        if isinstance(engine, EngineConfig):
            from tokenmill.engine.core_process import EngineCoreClient, use_engine_process

            if use_engine_process(cfg.engine_process, engine):
                self.state.llm = EngineCoreClient(
                    engine, cfg.max_queued_requests, cfg.queue_timeout, cfg.limits.grammar
                )
                self._log_serving()
                return
            engine = LLMEngine(engine)
        engine.structured.set_limits(cfg.limits.grammar)
        self.state.llm = AsyncLLM(engine, cfg.max_queued_requests, cfg.queue_timeout)
        self._log_serving()

    def _log_serving(self) -> None:
        # uvicorn's logger: shown with uvicorn's log config even when nobody set up logging
        logging.getLogger("uvicorn.error").info(
            "tokenmill is serving %r: OpenAI API at %s/v1", self.state.model_name, self.url
        )

    async def drain_and_exit(self) -> None:
        """Stop accepting, wait for the accepted requests, then stop uvicorn."""
        self.state.draining = True
        llm = self.state.llm
        if llm is not None:
            timeout = self.config.limits.shutdown_timeout
            logger.info(
                "draining: %d requests to finish within %g s (a second signal exits now)",
                llm.num_live,
                timeout,
            )
            if not await llm.drain(timeout):
                logger.warning("the drain took longer than shutdown_timeout=%g s", timeout)
                self.force_exit()
                return
        self._uv.should_exit = True

    def force_exit(self) -> None:
        """Stop now: abort whatever runs; open streams get an error event first."""
        logger.warning(
            "exiting now; aborting %d requests", self.state.llm.num_live if self.state.llm else 0
        )
        self.exit_code = 1
        self.state.draining = True
        llm = self.state.llm
        if llm is not None:
            llm.stop_accepting()
        if llm is None or self._loop is None or not self._loop.is_running():
            self._uv.force_exit = True
            self._uv.should_exit = True
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._abort_and_exit()))

    async def _abort_and_exit(self) -> None:
        """Fail every live request (its stream writes an error event), then stop uvicorn."""
        if self.state.llm is not None:
            await asyncio.to_thread(self.state.llm.shutdown, FORCED_EXIT_FLUSH_S * 10)
            await asyncio.sleep(FORCED_EXIT_FLUSH_S)  # let the handlers write the errors
        self._uv.force_exit = True
        self._uv.should_exit = True

    def _stop_engine(self) -> None:
        if self.state.llm is not None:
            self.state.llm.shutdown()


class _Uvicorn(uvicorn.Server):
    """uvicorn with tokenmill's shutdown: first signal drains, the second one exits."""

    def __init__(self, config: uvicorn.Config, owner: OpenAIServer) -> None:
        super().__init__(config)
        self.owner = owner

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        owner = self.owner
        if owner.state.draining or self.should_exit or owner._loop is None:
            owner.force_exit()
            return
        logger.info("got %s: draining", signal.Signals(sig).name)
        owner.state.draining = True  # /health and new requests see it at once
        if owner.state.llm is not None:
            owner.state.llm.stop_accepting()
        owner._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(owner.drain_and_exit()))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"can not listen on {host}:{port}: {exc.strerror}; pick another --port"
        ) from exc
    sock.set_inheritable(True)
    return sock
