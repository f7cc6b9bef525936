"""``AsyncPoolingLLM``: the server's front end of a ``PoolingEngine``.

Requests arrive tokenized (the handlers tokenize on the preprocessing pool, off the
event loop and off the engine thread). One engine thread owns the model: it takes
every job waiting, drops those whose client left or that waited past
``queue_timeout``, runs the rest of each task as one batch, and hands each job its
tensors. It has the attributes the routes and the metrics read from ``AsyncLLM``
(``engine``, ``stats``, ``tokenizer``, ``is_ready``, ``drain``...).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.engine.async_llm import admit
from tokenmill.errors import EngineDeadError, QueueTimeoutError
from tokenmill.metrics.stats import RequestFinished
from tokenmill.pooling.engine import PoolingEngine
from tokenmill.pooling.tokenize import Encoded
from tokenmill.threads import release_openmp_threads

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    inputs: Sequence[Encoded]
    task: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)


class AsyncPoolingLLM:
    def __init__(
        self,
        engine: PoolingEngine,
        max_queued_requests: int | None = None,
        queue_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.stats = engine.stats
        self.tokenizer = engine.tokenizer
        self.max_queued_requests = max_queued_requests
        self.queue_timeout = queue_timeout
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # guarded by _lock
        self._num_live = 0
        self._accepting = True
        self._dead: BaseException | None = None
        release_openmp_threads()  # this thread built the engine; the pooling thread computes
        self._thread = threading.Thread(target=self._run, name="tokenmill-pooling", daemon=True)
        self._thread.start()

    # -- state ---------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._accepting and self._dead is None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_live(self) -> int:
        return self._num_live

    # -- requests ------------------------------------------------------------------------
    async def run(self, inputs: Sequence[Encoded], task: str) -> list[torch.Tensor]:
        """The raw outputs of one request's inputs (finish them with ``engine.finish``).

        Raises QueueFullError / DrainingError / EngineDeadError at once, QueueTimeoutError
        after waiting too long; cancelling the caller drops the job before it runs."""
        self._admit()
        loop = asyncio.get_running_loop()
        job = _Job(inputs, task, loop.create_future(), loop)
        self._jobs.put(job)
        return await job.future

    async def reset_prefix_cache(self) -> int:
        return 0

    def _admit(self) -> None:
        admit(self)  # the text front end's rule
        self.stats.on_added()

    # -- lifecycle -------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    async def drain(self, timeout: float | None = None, poll: float = 0.05) -> bool:
        self.stop_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._num_live > 0 and self._thread.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll)
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop_accepting()
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                jobs = [self._jobs.get()]
                while not self._jobs.empty():
                    jobs.append(self._jobs.get_nowait())
                stop = None in jobs
                self._step([j for j in jobs if j is not None])
                if stop:
                    break
        except BaseException as exc:  # noqa: BLE001 - reported to every caller
            logger.exception("the pooling engine thread died")
            self._dead = exc
        finally:
            self._fail_pending(EngineDeadError(f"the engine stopped: {self._dead or 'shut down'}"))

    def _step(self, jobs: list[_Job]) -> None:
        now = time.monotonic()
        live = []
        for job in jobs:
            if job.future.done():  # the client left (its await was cancelled)
                self._finish(job, "cancelled")
            elif self.queue_timeout is not None and now - job.arrival > self.queue_timeout:
                self._finish(job, "timeout", QueueTimeoutError(
                    f"the request waited over queue_timeout={self.queue_timeout}s to start"
                ))  # fmt: skip
            else:
                live.append(job)
        with self._lock:
            self._num_queued -= len(live)
        for job in live:
            self.stats.on_started(job.arrival, now)
            self.stats.prompt_tokens += sum(len(x.token_ids) for x in job.inputs)
        self.stats.set_gauges(self._jobs.qsize(), len(live))
        for task in dict.fromkeys(j.task for j in live):
            group = [j for j in live if j.task == task]
            try:
                raw = self.engine.run([x for j in group for x in j.inputs], task)
            except Exception as exc:  # noqa: BLE001 - a bad batch fails its own jobs only
                logger.exception("a pooling batch failed")
                for job in group:
                    self._finish(job, "error", exc)
                continue
            start = 0
            for job in group:
                self._finish(job, "stop", raw[start : start + len(job.inputs)])
                start += len(job.inputs)
        self.stats.set_gauges(self._jobs.qsize(), 0)

    def _finish(self, job: _Job, reason: str, result: object = None) -> None:
        with self._lock:
            self._num_live -= 1
            if reason in ("cancelled", "timeout"):
                self._num_queued -= 1
        self.stats.on_request_finished(
            RequestFinished(
                ("cancelled" if reason == "timeout" else reason,), job.arrival, reason == "timeout"
            )
        )
        if reason != "cancelled":
            job.loop.call_soon_threadsafe(_resolve, job.future, result)

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            self._accepting = False
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None:
                with self._lock:
                    self._num_queued -= 1
                self._finish(job, "error", exc)


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
