"""Tensor and / or pipeline parallelism on worker processes (``distributed_executor_backend``
mp, or Ray actors).

The driver's ``ModelRunner`` runs rank 0's part through a ``driver_model`` driver, which
broadcasts each step's model inputs to the workers (``distributed/``); scheduling and
sampling stay here. A worker that dies fails the step in flight (its collective raises)
and every later one at once, with an error that names the worker.

A dead worker does not always make the driver's collective raise at once: with 4 ranks,
the driver may wait in a recv from a live rank that itself waits on the dead one, until
the collective timeout (``group.COLLECTIVE_TIMEOUT``, 120 s). A watchdog thread therefore
polls the workers while the engine runs and, once one has exited, kills the others: every
rank's sockets then close and each blocked collective raises within a poll interval.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tokenmill.distributed.launch import Ranks, WorkerDiedError, Workers
from tokenmill.executor.base import Executor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

WATCH_INTERVAL = 0.5
"""Seconds between the watchdog's liveness polls of the workers."""


class Watchdog:
    """Kills the live workers once one has exited (see the module docstring)."""

    def __init__(self, workers: Workers, interval: float = WATCH_INTERVAL) -> None:
        self.workers, self.interval = workers, interval
        self.dead: str | None = None
        """Why the first worker seen dead exited (the others die of the watchdog)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-ranks-watchdog",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before a clean stop, whose exits are no failure)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            dead = self.workers.dead()
            if dead is None:
                continue
            self.dead = dead
            logger.error("%s; stopping the other ranks so no collective waits on it", dead)
            for proc in self.workers.procs:
                if proc.is_alive():
                    proc.kill()
            return


class MultiprocExecutor(Executor):
    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        driver: Any = runner.model  # a distributed/driver_model driver
        if runner.state_step is not None:  # snapshot copies: the workers make them too
            runner.state_step = driver.recording(runner.state_step)
        if runner.rollback_rows is not None:  # rolled-back drafts: the workers' states too
            runner.mirror_rollback = driver.rolled_back
        self._dead: str | None = None
        self._stopped = False
        self._watchdog = Watchdog(ranks.workers)

    # The handle is the base's ``Any``: ``pipelined.PipelinedExecutor`` hands out its own.
    def launch(self, sched: SchedulerOutput) -> Any:
        self._check()
        try:
            return self.runner.launch(sched)
        except Exception as e:
            raise self._died(e) from e

    def collect(self, handle: Any) -> ModelRunnerOutput:
        self._check()
        return self.runner.collect(handle)

    def shutdown(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._watchdog.stop()
            self.ranks.stop(kill=self._dead is not None)

    def _check(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if self._stopped:
            raise WorkerDiedError("the engine's parallel workers were shut down")

    def _died(self, error: Exception) -> Exception:
        """Any failed step leaves the ranks out of step (the workers may wait in a
        collective the driver left): the workers are stopped and every later step fails at
        once. The message names a worker that exited (the usual cause), else the error."""
        dead = self._watchdog.dead or self.ranks.workers.wait_exit(timeout=2.0)
        self._dead = dead or (
            f"a parallel step failed ({type(error).__name__}: {error}); the ranks are "
            "out of step and the engine can not run steps any more, restart it"
        )
        self.shutdown()
        return WorkerDiedError(self._dead)
