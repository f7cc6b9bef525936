"""The default executor: the model runs in the engine's own process and thread."""

from __future__ import annotations

from tokenmill.executor.base import Executor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import LaunchedStep, ModelRunner, ModelRunnerOutput


class UniProcExecutor(Executor):
    """One ``ModelRunner`` on one device: launch/collect are direct calls."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def launch(self, sched: SchedulerOutput) -> LaunchedStep:
        return self.runner.launch(sched)

    def collect(self, handle: LaunchedStep) -> ModelRunnerOutput:
        return self.runner.collect(handle)
