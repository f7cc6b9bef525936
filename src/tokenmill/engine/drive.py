"""Who steps an ``LLMEngine``: one driver at a time.

An engine has two possible drivers: the offline API (``LLM.generate`` and friends), which
adds its requests and steps the engine in the caller's thread until they finish, and a
server's engine thread (``AsyncLLM``), which steps it while it has requests. ``LLM.serve``
(or an ``OpenAIServer`` on ``llm.engine``) makes both drive the same engine. Stepped from
two threads at once, each could step the other's requests, take their outputs (a served
request then never finishes; an offline run finds the engine idle with its requests
unfinished) and corrupt the step in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

IDLE_POLL = 0.002
"""Seconds between looks at a served engine that an offline run waits to find idle."""


class DriveLock:
    """The offline API holds it for a whole run (``offline``), a server's engine thread for
    one turn of its loop at a time (``turn``). An offline run on a served engine starts
    only when the engine has no request left (``served``), so it never steps a served
    request; the server's thread waits meanwhile and its new requests queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self.served = False
        """A server's engine thread drives the engine too (set by ``AsyncLLM``)."""

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with self._lock:
            yield

    @contextlib.contextmanager
    def offline(self, idle: Callable[[], bool]) -> Iterator[None]:
        """Hold the engine for this thread's run; ``idle()``: no request is unfinished."""
        me = threading.get_ident()
        if self._owner == me:  # a run inside this thread's own (a stream left open)
            yield
            return
        while True:
            self._lock.acquire()
            if not self.served or idle():
                break
            self._lock.release()
            time.sleep(IDLE_POLL)
        self._owner = me
        try:
            yield
        finally:
            self._owner = None
            self._lock.release()
