"""Worker threads that each run torch on one core, taking the most urgent task first.

Text-to-speech is many small tasks (a sentence's latent: hundreds of small ops; vocoder
pieces: a few big convolutions). Split over cores op by op (torch's OpenMP threads), every
op ends at a barrier, and on shared cores a descheduled partner stalls every op. Whole tasks
on single-threaded workers share nothing but the task queue.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

Key = tuple[int, ...]


class TaskPool:
    """``workers`` daemon threads; ``submit(key, fn)`` runs ``fn()`` on the first free one
    (in inference mode), lowest ``key`` first among the tasks waiting (ties: first
    submitted)."""

    def __init__(self, workers: int) -> None:
        self._heap: list[tuple[Key, int, Callable[[], Any], Future[Any]]] = []
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._closed = False
        started = threading.Barrier(workers + 1)
        default = torch.get_num_threads()
        self._threads = [
            threading.Thread(target=self._work, args=(started,), name=f"speech-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        started.wait()
        # set_num_threads in the workers also set the default that threads starting torch
        # later inherit: put it back (a worker keeps its own setting, OpenMP's is per thread)
        torch.set_num_threads(default)

    def _work(self, started: threading.Barrier) -> None:
        torch.get_num_threads()  # torch's per-thread setup first: it would undo the next line
        torch.set_num_threads(1)
        started.wait()
        with torch.inference_mode():
            self._serve()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._closed:
                    self._cond.wait()
                if not self._heap:
                    return
                _, _, fn, future = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- handed to whoever waits on it
                future.set_exception(e)

    def submit(self, key: Key, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this task pool was closed")
            heapq.heappush(self._heap, (key, next(self._order), fn, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Cancel the waiting tasks, let the running ones finish and wait for the workers to
        end (unless called from one). A worker still alive when the interpreter exits is
        stopped wherever it is: one waking inside a torch call (whose GIL release is
        noexcept C++) aborts the process ("terminate called without an active exception",
        seen after a close just before exit)."""
        with self._cond:
            self._closed = True
            for *_, future in self._heap:
                future.cancel()
            self._heap.clear()
            self._cond.notify_all()
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
