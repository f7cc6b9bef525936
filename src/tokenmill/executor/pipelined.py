"""Pipeline parallelism with the stages overlapping across steps (issue 18).

Two steps are in flight: ``launch(t + 1)`` sends step t + 1's inputs to every stage
(stage 0 starts on them at once) and returns; ``collect(t)`` runs step t's last stage
here, on the driver, and samples it. The engine's asynchronous-scheduling loop
(``engine/pipeline.py``) already calls ``launch(t + 1)`` before ``collect(t)``, and the
scheduler's interleave (``scheduler/interleave.py``) keeps step t + 1 free of the sequences
step t is still sampling, so its inputs are all on the host. With two stages stage 0
computes one group of sequences while the driver computes and samples the other.

Why this design and not a scheduler with one queue per stage ("virtual engines"): the
engine already has the seam for a step in flight (async scheduling: launch, then collect
the step before), so nothing in the loop changes; the groups form from the scheduler's
one rule (skip a sequence with a token in flight, take half), so arrivals, aborts and
preemption need nothing new; and the one-process path is untouched (the rule is an
``is None`` check).

Why threads: ``ModelRunner.launch`` is one call (inputs, forward, sampling), and the
driver must pause a step between its broadcast and its last stage. Each step runs on a
thread of its own lane, with the lane's own ``ModelRunner`` (its staging buffers and its
last-sampled ids; the model, the KV caches and the sampler are shared), and the driver
model parks it there (``PipelineDriver.park``). Only one thread runs at a time (a baton:
the engine thread waits while a step's thread runs up to its park or its end, and the
step's thread waits otherwise), so every collective, every KV write and every draw of the
sampler's generator happens in the order one thread would make them: the threads only
let a call pause in the middle.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.distributed.driver_model import PipelineDriver
from tokenmill.distributed.launch import Ranks, WorkerDiedError
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.scheduler import SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner, ModelRunnerOutput

LANES = 2
"""Steps in flight: the engine loop's depth (``scheduler/interleave.STEPS_IN_FLIGHT``)."""


@dataclass(eq=False)
class _Step:
    """One step on its lane: ``sent`` once its inputs went out (or it ended), ``go`` when
    the engine collects it, ``done`` with its tokens or its error."""

    sched: SchedulerOutput
    sent: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    output: ModelRunnerOutput | None = None
    error: BaseException | None = None


class _Cancelled(Exception):
    """A parked step released by ``shutdown``: it must not touch the ranks."""


class _Lane:
    """A thread and its runner, running the steps put to it one after another."""

    def __init__(self, runner: ModelRunner, index: int, current: threading.local) -> None:
        self.runner = runner
        self.jobs: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
        self._current = current
        self.thread = threading.Thread(
            target=self._loop, name=f"tokenmill-pp-lane{index}", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        while (step := self.jobs.get()) is not None:
            self._current.step = step
            try:
                step.output = self.runner.collect(self.runner.launch(step.sched))
            except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
                step.error = exc
            finally:
                self._current.step = None
                step.sent.set()
                step.done.set()


def _lane_runner(runner: ModelRunner) -> ModelRunner:
    """A runner on the same model, caches and sampler, with its own per-step state."""
    return ModelRunner(
        runner.model, runner.kv_caches, runner.block_size, runner.device, runner.sampler,
        runner.backend, runner.decode, runner.state_slot, runner.state_step, runner.snapshots,
    )  # fmt: skip


class PipelinedExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` for pipeline stages (one TP rank each) that keeps two steps
    in flight. Errors: a failed step stops the ranks, as there (``_died``)."""

    interleaves = True

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        super().__init__(runner, ranks)
        driver = runner.model
        assert isinstance(driver, PipelineDriver), "the driver is the last pipeline stage"
        self.driver = driver
        self._current = threading.local()
        driver.park = self._park
        runners = [runner, *(_lane_runner(runner) for _ in range(LANES - 1))]
        self._lanes = [_Lane(r, i, self._current) for i, r in enumerate(runners)]
        self._next = 0
        self._open: list[_Step] = []
        """Launched, not collected (at most ``LANES``)."""
        self._cancelled = False

    def launch(self, sched: SchedulerOutput) -> _Step:
        """Send the step's inputs to every stage; return once they are out (stage 0 is on
        them), its last stage left for ``collect``."""
        self._check()
        step = _Step(sched)
        lane = self._lanes[self._next]
        self._next = (self._next + 1) % LANES
        self._open.append(step)
        lane.jobs.put(step)
        step.sent.wait()
        if step.error is not None:
            self._open.remove(step)
            raise self._died(step.error) from step.error
        return step

    def collect(self, handle: _Step) -> ModelRunnerOutput:
        """Run the step's last stage and sampler (on its lane); its tokens."""
        self._check()
        handle.go.set()
        handle.done.wait()
        self._open.remove(handle)
        if handle.error is not None:
            raise self._died(handle.error) from handle.error
        assert handle.output is not None
        return handle.output

    def _park(self) -> None:
        """In a step's thread, after its broadcast: hand the baton back until collected.
        (A forward from the engine thread itself, with no step of a lane, passes.)"""
        step: _Step | None = getattr(self._current, "step", None)
        if step is None:
            return
        step.sent.set()
        step.go.wait()
        if self._cancelled:
            raise _Cancelled("the engine's parallel workers were shut down")

    def shutdown(self) -> None:
        """Release parked steps (they raise, touching nothing), end the lanes, stop the
        ranks."""
        self._cancelled = True
        for step in self._open:
            step.go.set()
        for lane in self._lanes:
            lane.jobs.put(None)
        super().shutdown()

    def _died(self, error: BaseException) -> Exception:
        if isinstance(error, WorkerDiedError):
            return error
        exc = error if isinstance(error, Exception) else RuntimeError(repr(error))
        return super()._died(exc)


def pipelines(config: EngineConfig, runner: ModelRunner) -> bool:
    """Whether an engine's pipeline stages overlap across steps: one rank per stage
    (``ParallelConfig.stages_overlap``), async scheduling on (auto: on CUDA, where each
    rank has its own device; on CPU it measured slower on shared cores, so it is asked for), no
    speculative decoding (a step with drafts is never kept in flight, its sequences would
    skip every other step) and a text model whose runner keeps no state of its own
    across steps beyond its staging (no media encoder, no feature tap, no fast path, no
    recurrent state slots: a step's snapshot restores on the driver would run before the
    step before it saved)."""
    plain = runner.mm is None and runner.tap is None and runner.decode is None
    plain = plain and runner.state_slot is None  # state slots: snapshot copies stay in order
    return (
        config.parallel.stages_overlap
        and config.overlaps_steps()
        and config.speculative is None
        and plain
        and isinstance(runner.model, PipelineDriver)
    )
