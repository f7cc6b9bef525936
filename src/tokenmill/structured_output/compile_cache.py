"""Where grammars compile, and the compiled ones kept for reuse.

``CompilePool``: a few daemon threads with a large native stack (``STACK_BYTES``).
llguidance recurses on the grammar's structure; the limits in ``limits.py`` keep
requests far from the depth that overflows an 8 MiB stack, and the big stack is
the margin behind them. Only the pages a compile touches are ever committed.

``GrammarCache``: compiled grammars (their futures) by spec, least recently used
first out, bounded by the estimated bytes of the finished ones. The estimate of
one grammar is the resident-memory growth measured around its compile (another
thread's allocations can blur it; it is a budget, not an accounting), at least a
``TEXT_COST`` bytes per byte of grammar text. An evicted grammar is freed once the
requests using it finish (their matchers hold the last references).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from tokenmill.threads import then_release

T = TypeVar("T")

STACK_BYTES = 256 * 1024 * 1024
"""Native stack of a compile thread (virtual memory; 32x the usual 8 MiB)."""
MIN_COST = 64 * 1024
"""Least estimated size of one compiled grammar."""
TEXT_COST = 48
"""Least estimated bytes per byte of grammar text (a 100 kB alternation of words compiles
to about 5.5 MB; measured growth underestimates when freed memory is reused)."""

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_stack_lock = threading.Lock()


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def start_thread(target: Callable[[], None], name: str, stack_bytes: int) -> threading.Thread:
    """A daemon thread with a ``stack_bytes`` native stack."""
    with _stack_lock:  # stack_size is process-wide: set it only around this start
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


class CompilePool:
    """``submit(fn, *args) -> Future`` on ``num_threads`` big-stack threads, started lazily."""

    def __init__(
        self, num_threads: int = 2, name: str = "tokenmill-grammar", stack_bytes: int = STACK_BYTES
    ) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._num = num_threads
        self._name = name
        self._stack = stack_bytes
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], *args) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            if len(self._threads) < self._num:
                self._threads.append(
                    start_thread(self._work, f"{self._name}-{len(self._threads)}", self._stack)
                )
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(then_release(fn, *args))  # the engine thread computes
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(None)


@dataclass
class _Entry(Generic[T]):
    future: Future[T]
    cost: int = 0
    """Estimated bytes once compiled (0 while compiling: never evicted then)."""


class GrammarCache(Generic[T]):
    """Futures of compiled grammars by key, LRU, bounded by ``max_bytes`` (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[object, _Entry[T]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """Estimated bytes of the finished grammars held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get_or_start(self, key: object, start: Callable[[], Future[T]]) -> Future[T]:
        """The key's future (now the most recent), or ``start()``'s, remembered."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(start())
            self._entries.move_to_end(key)
            return entry.future

    def set_cost(self, key: object, future: Future[T], cost: int) -> None:
        """Record a finished compile's size, then evict down to the budget."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.future is not future:
                return
            self._bytes += cost - entry.cost
            entry.cost = cost
            self._evict()

    def _evict(self) -> None:
        for key in list(self._entries):
            if self._bytes <= self.max_bytes:
                return
            entry = self._entries[key]
            if not entry.future.done() or len(self._entries) == 1:
                continue
            del self._entries[key]
            self._bytes -= entry.cost
