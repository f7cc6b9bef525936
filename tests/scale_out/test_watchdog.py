"""The ranks' watchdog (``executor/multiproc.py``): once a worker has exited, it kills the
live ones, so that no rank waits out the collective timeout on a peer that waits on the
dead one; it names the first dead worker, and a clean stop kills nobody."""

from __future__ import annotations

import time

from tokenmill.distributed.launch import Workers
from tokenmill.executor.multiproc import Watchdog


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.exitcode, self.killed = pid, None, False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9


def _workers(n: int) -> tuple[Workers, list[FakeProc]]:
    procs = [FakeProc(100 + i) for i in range(n)]
    return Workers(procs, [None] * n), procs  # type: ignore[list-item]


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_dead_worker_gets_the_live_ones_killed_and_is_the_one_named():
    workers, procs = _workers(3)
    dog = Watchdog(workers, interval=0.02)
    try:
        time.sleep(0.1)
        assert not any(p.killed for p in procs)  # all alive: nobody is touched
        procs[2].exitcode = 1  # rank 3 dies (its own failure, not a kill)
        assert _wait(lambda: procs[0].killed and procs[1].killed)
        assert not procs[2].killed
        assert dog.dead is not None and "worker rank 3" in dog.dead and "exit code 1" in dog.dead
    finally:
        dog.stop()


def test_a_stopped_watchdog_kills_nobody():
    workers, procs = _workers(2)
    dog = Watchdog(workers, interval=0.02)
    dog.stop()  # a clean stop begins: the workers' exits that follow are no failure
    procs[0].exitcode = 0
    time.sleep(0.1)
    assert not procs[1].killed and dog.dead is None
