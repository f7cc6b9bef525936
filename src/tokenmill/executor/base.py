"""The boundary between the engine loop and model execution.

The engine hands every scheduled step to an ``Executor`` and never touches the model or
its device itself. In process (``UniProcExecutor``) that is one ``ModelRunner``; a
multi-process or tensor-parallel executor implements the same three calls over its
workers (broadcast the step, gather the driver worker's tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunnerOutput


class Executor(ABC):
    """Runs scheduled steps. Contract: ``launch`` queues a step and returns a handle
    without waiting for the device; ``collect(handle)`` waits for that step and returns
    its tokens; handles are collected in launch order, at most two outstanding (the step
    in flight and the one just launched). Errors of either call are the step's only."""

    @abstractmethod
    def launch(self, sched: SchedulerOutput) -> Any:
        """Queue one step; returns an opaque handle for ``collect``."""

    @abstractmethod
    def collect(self, handle: Any) -> ModelRunnerOutput:
        """Wait for a launched step; its new tokens per scheduled sequence."""

    interleaves = False
    """Whether consecutive steps must hold disjoint sequences (``scheduler/interleave.py``):
    pipeline stages that overlap across steps (``pipelined.PipelinedExecutor``)."""

    def shutdown(self) -> None:  # noqa: B027 (a default, not abstract: in process there is nothing to release)
        """Release workers and devices (idempotent). In process: nothing to do."""
