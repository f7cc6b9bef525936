"""One step as the recurrent layers run it, built once per forward from the step context."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention import StepContext


@dataclass(frozen=True)
class Run:
    """A sequence with more than one new token: rows ``start:end`` of the batch."""

    start: int
    end: int
    slot: int
    fresh: bool
    """Its context starts at token 0 this step: the state starts from zeros."""


@dataclass(frozen=True)
class StatePlan:
    """The one-token sequences of a step go through a layer together (a batched state
    update), the longer ones one by one (a chunked scan from their state).

    Invariant: every row of the batch belongs to exactly one single or one run."""

    rows: torch.Tensor | None
    """[B1] int64 batch rows of the one-token sequences; None when every row is one (an
    all-decode step: no gather)."""
    slots: torch.Tensor
    """[B1] int64 their state slots."""
    keep: torch.Tensor
    """[B1] float32: 0 for a fresh sequence (its slot holds a stale state), else 1."""
    runs: tuple[Run, ...]

    @property
    def num_singles(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def of(cls, ctx: StepContext) -> StatePlan:
        meta, qsl = ctx.state, ctx.attn.query_start_loc
        assert meta is not None, "recurrent layers need the step's state slots"
        singles: list[int] = []
        runs: list[Run] = []
        for i, (start, end) in enumerate(zip(qsl, qsl[1:])):
            if end - start == 1:
                singles.append(i)
            elif end > start:
                runs.append(Run(start, end, meta.slot_list[i], meta.fresh_list[i]))
        device = meta.slots.device
        if len(singles) == len(meta.slot_list):  # every sequence decodes one token
            rows, slots, fresh = None, meta.slots, meta.fresh
        else:
            index = torch.tensor(singles, dtype=torch.int64, device=device)
            rows = torch.tensor([qsl[i] for i in singles], dtype=torch.int64, device=device)
            slots, fresh = meta.slots.index_select(0, index), meta.fresh.index_select(0, index)
        keep = (~fresh).to(torch.float32)
        return cls(rows, slots, keep, tuple(runs))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the one-token sequences' rows [B1, ...]."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write the one-token sequences' rows [B1, ...] into out [T, ...]."""
        if self.rows is None:
            out.copy_(values)
        else:
            out.index_copy_(0, self.rows, values)
