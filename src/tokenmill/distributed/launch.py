"""Starting an engine's tensor / pipeline-parallel ranks: checks, worker processes, the
driver's rank.

``start_ranks(config)`` checks the sizes against the checkpoint (before any process
starts), starts ranks 1..tp*pp-1 as spawned processes or Ray actors (``ray_ranks``; they
begin loading their parts at once), and joins the process group as rank 0. ``Ranks.drive``
then tells the workers the KV cache size the driver chose and wraps the driver's part
(``driver_model``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.config import check_devices, check_shapes
from tokenmill.distributed.families import Family, family_of
from tokenmill.distributed.group import RankGroup, init_ranks, leave_ranks
from tokenmill.distributed.hybrid_split import split_of
from tokenmill.distributed.messages import Ready, Stop
from tokenmill.distributed.part import ModelPart
from tokenmill.distributed.stages import split_layers
from tokenmill.distributed.worker import WorkerArgs, model_part, worker_main
from tokenmill.engine.loading import LoadedModel
from tokenmill.errors import EngineDeadError, InvalidRequestError, UnsupportedModelError
from tokenmill.loader import load_checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.threads import configure_threads

if TYPE_CHECKING:
    from tokenmill.distributed.ray_ranks import RayOwner

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 600.0
"""Seconds a worker may take to import and load its shard."""


class WorkerDiedError(EngineDeadError):
    """A worker process (a tensor-parallel rank, a pipeline stage) ended; the engine can
    run no more steps."""


class Proc(Protocol):
    """What the driver watches of a rank: a ``multiprocessing`` process or a Ray actor
    (``ray_ranks.RayProc``)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def kill(self) -> None: ...


class Pipe(Protocol):
    def poll(self, timeout: float | None = 0.0) -> bool: ...
    def recv(self) -> Any: ...


@dataclass
class Workers:
    """Ranks 1.., each with a pipe for its startup reports."""

    procs: Sequence[Proc]
    pipes: Sequence[Pipe]
    ray: RayOwner | None = None
    """The Ray this engine started for its actors: shut down with them."""

    def wait(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Wait for one ``Ready`` from every worker; raise on an error report or an exit."""
        deadline = time.monotonic() + timeout
        for proc, pipe in zip(self.procs, self.pipes):
            while not pipe.poll(0.1):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise WorkerDiedError(self.describe(proc, "did not start"))
            report: Ready = pipe.recv()
            if report.error is not None:
                raise WorkerDiedError(f"worker rank {report.rank} failed to load:\n"
                                      f"{report.error}")  # fmt: skip

    def dead(self) -> str | None:
        """Why the workers can not run steps (the first that exited), or None."""
        for proc in self.procs:
            if not proc.is_alive():
                return self.describe(proc, "exited")
        return None

    def wait_exit(self, timeout: float) -> str | None:
        """``dead()`` once a worker is seen to exit within ``timeout`` seconds, else None."""
        deadline = time.monotonic() + timeout
        while (dead := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def describe(self, proc: Proc, what: str) -> str:
        rank = self.procs.index(proc) + 1
        return (
            f"worker rank {rank} (pid {proc.pid}) {what} "
            f"(exit code {proc.exitcode}); the engine can not run steps any more, restart it"
        )

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        if self.ray is not None:
            self.ray.stop()


@dataclass
class Ranks:
    """The driver's view of its engine's ranks."""

    group: RankGroup
    shard: ModelPart
    workers: Workers

    def drive(
        self, loaded: LoadedModel, num_blocks: int, num_slots: int, snapshot_rows: int = 0
    ) -> LoadedModel:
        """Give the workers the KV cache size (blocks, state slots, the recurrent-state
        snapshot pool's rows: 0 without one); ``loaded`` with the driver's model."""
        self.workers.wait()
        self.group.broadcast((num_blocks, num_slots, snapshot_rows))
        return dataclasses.replace(loaded, model=self.shard.driver(loaded.model))

    def stop(self, kill: bool = False) -> None:
        """Stop the workers and leave the group: a ``Stop`` broadcast, or (``kill``: the
        ranks are out of step, a worker may wait in a collective) kill them."""
        if not kill and self.workers.dead() is None:
            try:
                self.group.broadcast(Stop())
            except RuntimeError:
                logger.warning("stopping the parallel workers: broadcast failed")
                kill = True
        self.workers.stop(timeout=0 if kill else 10.0)
        leave_ranks()


def check_parallel_model(config: EngineConfig) -> None:
    """Raise a ValueError unless the checkpoint's model splits as ``config.parallel`` says."""
    parallel = config.parallel
    ckpt = load_checkpoint(config.model)
    model_cls = resolve_model_class(ckpt.hf_config.get("architectures"))
    family = family_of(model_cls)
    hf = family.text(ckpt.hf_config)  # the language model's (a vision checkpoint nests it)
    name = model_cls.__name__
    kinds = family.kinds(hf)
    if parallel.tensor_parallel_size > 1:
        split = split_of(model_cls, hf)
        problems = None if split is None else split.problems(parallel.tensor_parallel_size)
        check_shapes(hf, parallel.tensor_parallel_size, name, problems)
    stages = split_layers(family.arch(hf).num_layers, parallel.pipeline_parallel_size)
    check_stage_caches(kinds, stages, name)
    check_first_stage(family, ckpt.hf_config, stages, name)
    if config.torch_device().type == "cuda" and parallel.distributed_executor_backend == "mp":
        check_devices(parallel, torch.cuda.device_count())


def check_first_stage(family: Family, raw: dict[str, Any], stages: list[range], name: str) -> None:
    """The first stage holds at least the layers its family needs there (Qwen3-VL: one per
    DeepStack feature, which the stage that embeds adds after each of its first layers)."""
    need = family.first_stage_layers(raw)
    if len(stages[0]) < need:
        raise InvalidRequestError(
            f"the first pipeline stage of {name} holds {len(stages[0])} layers, but its "
            f"vision features are added after each of the first {need}: use a smaller "
            "pipeline_parallel_size"
        )


def check_stage_caches(kinds: list[frozenset[str]], stages: list[range], name: str) -> None:
    """The driver (the last stage) keeps the scheduler's cache groups: it must hold every
    kind of cache (paged blocks, state slots) that any earlier stage's layers hold."""
    last = frozenset().union(*(kinds[i] for i in stages[-1]))
    every = frozenset().union(*kinds)
    if not every <= last:
        missing = ", ".join(sorted(every - last))
        raise UnsupportedModelError(
            f"the last pipeline stage of {name} (layers {stages[-1].start}.."
            f"{stages[-1].stop - 1}) has no {missing} layer, which an earlier stage has; the "
            "driver keeps every kind of cache, so use a pipeline_parallel_size whose last "
            "stage holds both kinds"
        )


def start_ranks(config: EngineConfig) -> Ranks:
    """Check, spawn ranks 1.., join as rank 0. Each rank gets usable CPUs / ranks threads."""
    check_parallel_model(config)
    world = config.parallel.world_size  # tp x pp
    threads = max(1, configure_threads() // world)
    torch.set_num_threads(threads)
    port = _free_port()
    if config.parallel.distributed_executor_backend == "ray":
        from tokenmill.distributed.ray_ranks import start_actors

        procs, pipes, address, owner = start_actors(config, world, threads, port)
        workers = Workers(procs, pipes, owner)
    else:
        address = f"tcp://127.0.0.1:{port}"
        workers = _spawn(config, world, threads, address)
    try:
        workers.wait()  # imported: they are about to join
        group = init_ranks(0, world, address, config.torch_device())
        part = model_part(config, group)  # the workers make the same stage groups
    except BaseException:
        workers.stop(timeout=0)
        raise
    logger.info("%s: %d ranks, %d CPU threads each", config.parallel, world, threads)
    return Ranks(group, part, workers)


def _spawn(config: EngineConfig, world: int, threads: int, address: str) -> Workers:
    """Ranks 1.. as spawned processes of this machine (they begin loading at once)."""
    if mp.current_process().daemon:
        raise ValueError(
            f"{world} ranks means worker processes, which a daemonic process (the server's "
            "--engine-process on) can not have; use --engine-process off or "
            "distributed_executor_backend='ray'"
        )
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    pipes: list[Connection] = []
    for rank in range(1, world):
        ours, theirs = ctx.Pipe(duplex=False)
        args = WorkerArgs(config, rank, world, address, threads)
        proc = ctx.Process(target=worker_main, args=(args, theirs), daemon=True,
                           name=f"tokenmill-rank{rank}")  # fmt: skip
        proc.start()
        procs.append(proc)
        pipes.append(ours)
    return Workers(procs, pipes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
