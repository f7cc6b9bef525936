"""The step pipeline: the one owner of the step in flight.

One overlap loop (asynchronous scheduling): launch step N+1, then wait for step N and
hand back its result, so the host applies N's tokens while N+1 runs on the device.
Without overlap every launched step is drained before the next one is scheduled. A step
whose launch or collect raises comes back as a failed ``StepResult``: it fails its own
requests, never the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.executor import Executor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """A finished step: its schedule, and its tokens or why it failed."""

    sched: SchedulerOutput
    output: ModelRunnerOutput | None
    error: str | None = None


class StepPipeline:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._in_flight: tuple[SchedulerOutput, Any] | None = None

    @property
    def busy(self) -> bool:
        """Whether a launched step has not been collected yet."""
        return self._in_flight is not None

    def launch(self, sched: SchedulerOutput, keep_in_flight: bool) -> list[StepResult]:
        """Launch ``sched``; then collect the step that was in flight before it (which ran
        while this one was being prepared and launched). With ``keep_in_flight`` the new
        step stays in flight (collected by the next call or ``drain``); otherwise it is
        waited for too. Returns the finished steps, oldest first."""
        try:
            handle = self.executor.launch(sched)
        except Exception as exc:  # a broken step fails its requests, not the engine
            logger.exception("model step failed")
            return [*self.drain(), StepResult(sched, None, f"{type(exc).__name__}: {exc}")]
        done = self.drain()
        self._in_flight = (sched, handle)
        return done if keep_in_flight else done + self.drain()

    def drain(self) -> list[StepResult]:
        """Wait for the step in flight, if any."""
        if self._in_flight is None:
            return []
        sched, handle = self._in_flight
        self._in_flight = None
        try:
            return [StepResult(sched, self.executor.collect(handle))]
        except Exception as exc:
            logger.exception("model step failed")
            return [StepResult(sched, None, f"{type(exc).__name__}: {exc}")]
