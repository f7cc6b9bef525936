"""What the driver tells its workers, one object per broadcast (``RankGroup.broadcast``).

Per step: one ``Forward`` (the step's model inputs; each worker adds its own KV caches),
then one ``Logits`` per scoring call (the final hidden rows that sample, or prompt rows
for prompt logprobs), so the vocabulary-parallel head gathers logits of those rows only;
with speculative decoding on recurrent layers, one ``RollBack`` when a verify step is
collected (the state of each sequence's accepted drafts copied into its slot).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tokenmill.attention import AttentionMetadata, StateMetadata
from tokenmill.attention.context import InputEmbeds
from tokenmill.kv_cache.snapshots import StateStep
from tokenmill.worker.state_rollback import RollbackCopies

M = TypeVar("M")


def moved(msg: M, device: torch.device | str) -> M:
    """``msg`` with every tensor in it (nested dataclasses too) on ``device``: the driver
    sends host tensors (a pickled CUDA tensor would come back on the driver's device),
    each worker moves them to its own. On the CPU nothing is copied."""
    return _move(msg, torch.device(device))


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _move(getattr(obj, f.name), device)
                   for f in dataclasses.fields(obj) if f.init}  # fmt: skip
        return dataclasses.replace(obj, **changes)
    return obj


@dataclass(frozen=True)
class Forward:
    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64, or [3, T] (M-RoPE: a step with media on a Qwen-VL family)."""
    attn: AttentionMetadata
    adapter_ids: torch.Tensor | None = None
    input_embeds: InputEmbeds | None = None
    state: StateMetadata | None = None
    """Each sequence's state slot (the driver's scheduler chose it: the same slot id on
    every rank, each holding that rank's part of the state); its ``snapshots`` and
    ``rollback`` rows are left out (each rank has its own: ``worker.StepState``,
    ``worker.StepRollback``)."""
    snapshot: StateStep | None = None
    """The step's snapshot copies (restores before the forward, saves after), which each
    rank makes on its own caches; None: no snapshot pool, or nothing to copy."""


def forward_of(input_ids: torch.Tensor, positions: torch.Tensor, ctx: object,
               snapshot: StateStep | None = None) -> Forward:  # fmt: skip
    """The broadcast of one ``forward(input_ids, positions, ctx)`` call, tensors on the host."""
    from tokenmill.attention import StepContext

    assert isinstance(ctx, StepContext)
    state = ctx.state
    if state is not None:
        state = dataclasses.replace(state, snapshots=None, rollback=None)
    step = Forward(input_ids, positions, ctx.attn, ctx.adapter_ids, ctx.input_embeds, state,
                   snapshot)  # fmt: skip
    return moved(step, "cpu")


@dataclass(frozen=True)
class Logits:
    hidden: torch.Tensor
    """[N, hidden]: the rows to score (the same on every rank after the last all-reduce)."""


@dataclass(frozen=True)
class RollBack:
    """A collected verify step's copies (``state_rollback.RollbackCopies``), which each
    worker makes from its oldest step's rollback rows into its own state slots."""

    copies: RollbackCopies


@dataclass(frozen=True)
class Stop:
    """Leave the loop and the process group."""


@dataclass(frozen=True)
class Ready:
    """A worker's startup report over its pipe: loaded (``error`` None) or why not."""

    rank: int
    error: str | None = None
