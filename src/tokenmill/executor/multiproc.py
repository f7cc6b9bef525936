"""Tensor and / or pipeline parallelism on worker processes (``distributed_executor_backend``
mp, or Ray actors).

The driver's ``ModelRunner`` runs rank 0's part through a ``driver_model`` driver, which
broadcasts each step's model inputs to the workers (``distributed/``); scheduling and
sampling stay here. A worker that dies fails the step in flight (its collective raises)
and every later one at once, with an error that names the worker.
"""

from __future__ import annotations

from typing import Any

from tokenmill.distributed.launch import Ranks, WorkerDiedError
from tokenmill.executor.base import Executor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput


class MultiprocExecutor(Executor):
    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        if runner.state_step is not None:  # snapshot copies: the workers make them too
            driver: Any = runner.model  # a distributed/driver_model driver
            runner.state_step = driver.recording(runner.state_step)
        self._dead: str | None = None
        self._stopped = False

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
        dead = self.ranks.workers.wait_exit(timeout=2.0)
        self._dead = dead or (
            f"a parallel step failed ({type(error).__name__}: {error}); the ranks are "
            "out of step and the engine can not run steps any more, restart it"
        )
        self.shutdown()
        return WorkerDiedError(self._dead)
