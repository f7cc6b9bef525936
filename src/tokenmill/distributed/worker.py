"""A tensor- and/or pipeline-parallel worker (ranks 1.., a process or a Ray actor): load its shard, then run what the driver
broadcasts until told to stop.

The worker never schedules or samples: per step it receives the step's model inputs
(``messages.Forward``), runs its shard over them with its own KV caches (the layers'
collectives meet the other ranks'), then takes part in each ``Logits`` call. A worker
that fails exits; its closed sockets fail the driver's next collective.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed.encoder_part import with_encoder_part
from tokenmill.distributed.families import family_of
from tokenmill.distributed.grid import Grid
from tokenmill.distributed.group import RankGroup, init_ranks, leave_ranks, stage_group
from tokenmill.distributed.hybrid_split import split_of
from tokenmill.distributed.messages import Forward, Ready, RollBack, Stop, moved
from tokenmill.distributed.nested import nested
from tokenmill.distributed.part import ModelPart
from tokenmill.distributed.shard import TPShard
from tokenmill.distributed.stages import PPStage
from tokenmill.distributed.tp_stage import TPStage
from tokenmill.engine.loading import load_model
from tokenmill.kv_cache.snapshot_copies import SnapshotTensors
from tokenmill.loader import load_checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.worker.model_runner import allocate_kv_caches
from tokenmill.worker.state_rollback import RollbackRows, copy_rows

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    size: int
    address: str
    """tcp://host:port of the process group's rendezvous (the driver's)."""
    num_threads: int
    device_index: int | None = None
    """The CUDA device to use; None: the rank's own (``device_of``). A Ray actor sees only
    the one GPU Ray gave it, as device 0."""


def device_of(config: EngineConfig, index: int) -> torch.device:
    """cuda:index (of the visible devices; a rank's is its rank) on CUDA, else the CPU."""
    device = config.torch_device()
    return torch.device("cuda", index) if device.type == "cuda" else device


def model_part(config: EngineConfig, group: RankGroup) -> ModelPart:
    """This rank's part of the checkpoint's model: a tensor-parallel shard, a stage, or a
    shard of a stage (of the language model; a media encoder is the driver's whole).
    Collective with TP and PP together (the stages' groups are made)."""
    raw = load_checkpoint(config.model).hf_config
    model_cls = resolve_model_class(raw.get("architectures"))
    family = family_of(model_cls)
    hf = family.text(raw)  # the language model's config (nested in a vision checkpoint)
    cfg = family.arch(hf)
    parallel = config.parallel
    grid = Grid(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    split = split_of(model_cls, hf)
    part: ModelPart
    if grid.pp == 1:
        part = TPShard(cfg, group, split)
    elif grid.tp == 1:
        part = PPStage(cfg, group, grid, family, hf)
    else:
        stage = PPStage(cfg, group, grid, family, hf)
        part = TPStage(TPShard(cfg, stage_group(group, grid), split), stage)
    return with_encoder_part(nested(part, family), family, group.rank)


class Reports(Protocol):
    """Where a worker sends its startup reports: a pipe's end, or a Ray queue's."""

    def send(self, obj: Any) -> None: ...


def worker_main(args: WorkerArgs, conn: Connection | Reports) -> None:
    """The process's entry point (multiprocessing ``spawn``)."""
    torch.set_num_threads(args.num_threads)
    config = args.config
    device = device_of(config, args.rank if args.device_index is None else args.device_index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=str(device))
    try:
        conn.send(Ready(args.rank))  # imported: the driver may join the group now
        group = init_ranks(args.rank, args.size, args.address, device)
        part = model_part(config, group)
        loaded = load_model(config, part)
    except Exception:
        conn.send(Ready(args.rank, traceback.format_exc()))
        return
    conn.send(Ready(args.rank))
    sizes = group.broadcast()  # (num_blocks, num_slots, snapshot rows) the driver chose
    assert isinstance(sizes, tuple)
    num_blocks, num_slots, rows = sizes
    caches = allocate_kv_caches(
        loaded.model, num_blocks, config.block_size, loaded.dtype, device, num_slots=num_slots
    )
    handlers = dict(part.handlers(loaded.model, caches))
    if rows:  # the hybrid prefix cache: this rank's own snapshot rows
        snapshots = SnapshotTensors(loaded.model.cache_specs(), caches, rows)
        handlers[Forward] = StepState(snapshots, caches).around(handlers[Forward])
    if num_slots and config.speculative is not None:  # drafts on recurrent layers
        rollback = StepRollback(RollbackRows(loaded.model.cache_specs(), caches), caches)
        handlers[Forward] = rollback.around(handlers[Forward])
        handlers[RollBack] = rollback.roll_back
    try:
        serve_steps(handlers, group, device)
    finally:
        leave_ranks()


@dataclasses.dataclass(frozen=True)
class StepState:
    """A worker's recurrent-state snapshots: the driver's step names the copies (restores
    of admitted prefixes, saves at chunk ends, ``messages.Forward.snapshot``), each rank
    makes them between its own slots and rows, around its forward, as the driver's runner
    does around its own. Same rows and slots everywhere: the driver's pool chose them."""

    snapshots: SnapshotTensors
    caches: list

    def around(self, forward: Callable[[Forward], object]) -> Callable[[Forward], object]:
        def run(m: Forward) -> object:
            if m.snapshot is not None:
                self.snapshots.restore(m.snapshot, self.caches)
            if m.state is not None:  # the rows the scans keep states in: this rank's
                m = dataclasses.replace(
                    m, state=dataclasses.replace(m.state, snapshots=self.snapshots.tensors)
                )
            out = forward(m)
            if m.snapshot is not None and m.snapshot.saves_after:
                self.snapshots.save(m.snapshot, self.caches)
            return out

        return run


class StepRollback:
    """A worker's rollback rows for speculative decoding on recurrent layers: a verify
    step keeps each draft position's state in rows of its own (``Forward.state.run_keeps``
    names them, as on the driver), and the driver's ``RollBack`` at the step's collect
    says which row goes into which slot. Steps are collected in the order they were
    sent (two may be in flight with asynchronous scheduling): a queue of their rows."""

    def __init__(self, rows: RollbackRows, caches: list) -> None:
        self.rows, self.caches = rows, caches
        self.pending: deque[list[torch.Tensor | None]] = deque()

    def around(self, forward: Callable[[Forward], object]) -> Callable[[Forward], object]:
        def run(m: Forward) -> object:
            count = 0 if m.state is None else sum(len(k) for k in m.state.run_keeps)
            if count and m.state is not None:
                kept = self.rows.take(count)
                self.pending.append(kept)
                m = dataclasses.replace(m, state=dataclasses.replace(m.state, rollback=kept))
            return forward(m)

        return run

    def roll_back(self, m: RollBack) -> None:
        kept = self.pending.popleft()
        copy_rows(kept, self.caches, m.copies)
        self.rows.give(kept)


def serve_steps(
    handlers: Mapping[type, Callable[[Any], object]], group: RankGroup, device: torch.device
) -> None:
    """Run the driver's broadcasts (their tensors moved to ``device``) until ``Stop``."""
    with torch.inference_mode():
        while not isinstance(msg := group.broadcast(), Stop):
            handlers[type(msg)](moved(msg, device))
