"""One engine's ranks on torch.distributed: the device group and its collectives.

Rank 0 is the driver (the engine's own process); ranks 1.. are worker processes. Two
process groups: ``device`` for the layers' all-reduce / all-gather (gloo on CPU, NCCL on
CUDA) and ``control`` (always gloo, every rank) for the driver's step messages, pickled
objects. With tensor and pipeline parallelism together each stage's layers reduce over
their own ``device`` group (``stage_group``); ``control`` stays every rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.distributed.grid import Grid

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""A collective that waits longer than this for a peer raises (a hung worker; a dead one
closes its sockets and fails the collective at once)."""


@dataclass(frozen=True)
class RankGroup:
    """This process's place among the engine's ranks."""

    rank: int
    size: int
    device: dist.ProcessGroup
    control: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        dist.all_reduce(x, group=self.device)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank r's columns at r * n."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device)
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj: object = None) -> object:
        """The driver's ``obj`` on every rank of the engine (workers pass None and get it);
        a stage's ``RankGroup`` too, since its ``control`` is every rank's."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def init_ranks(rank: int, size: int, address: str, device: torch.device) -> RankGroup:
    """Join the engine's process group at ``address`` (tcp://host:port, the driver's)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    assert dist.group.WORLD is not None
    return RankGroup(rank, size, dist.group.WORLD, control)


def stage_group(world: RankGroup, grid: Grid) -> RankGroup:
    """This rank's place in its stage's tensor-parallel group (``grid.Grid``). Collective:
    every rank makes every stage's group, in the same order (torch.distributed's rule)."""
    mine: dist.ProcessGroup | None = None
    for ranks in grid.stage_ranks():
        group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
        if world.rank in ranks:
            mine = group
    assert mine is not None
    return RankGroup(grid.tp_rank_of(world.rank), grid.tp, mine, world.control)


def leave_ranks() -> None:
    """Destroy this process's groups (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
