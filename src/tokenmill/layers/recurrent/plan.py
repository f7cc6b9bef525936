"""One step as the recurrent layers run it, built once per forward from the step context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import RecurrentState


@dataclass(frozen=True)
class Run:
    """A sequence with more than one new token: rows ``start:end`` of the batch."""

    start: int
    end: int
    slot: int
    fresh: bool
    """Its context starts at token 0 this step: the state starts from zeros."""
    position: int = 0
    """The sequence position of its first row."""
    saves: tuple[tuple[int, int], ...] = ()
    """(tokens into the run, snapshot row) of the states to keep inside it
    (``kv_cache/snapshots.py``): each at a multiple of the scans' chunk, so the scan,
    aligned to absolute positions (``lead``), reaches it at one of its own chunk ends."""

    def lead(self, chunk: int) -> int:
        """Tokens of padding before the run that align a scan's chunks to absolute
        positions (0 when nothing is kept: the scan runs as without snapshots)."""
        return self.position % chunk if self.saves else 0

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(o for o, _ in self.saves)


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
    snapshots: Sequence[torch.Tensor | None] | None = None
    """Each layer's snapshot rows (``StateMetadata.snapshots``), for the runs' saves."""

    @property
    def num_singles(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def of(cls, ctx: StepContext) -> StatePlan:
        meta, qsl = ctx.state, ctx.attn.query_start_loc
        assert meta is not None, "recurrent layers need the step's state slots"
        singles: list[int] = []
        runs: list[Run] = []
        seq_lens, saves = ctx.attn.seq_lens, meta.run_saves
        for i, (start, end) in enumerate(zip(qsl, qsl[1:])):
            if end - start == 1:
                singles.append(i)
            elif end > start:
                position = seq_lens[i] - (end - start)
                run_saves = saves[i] if saves else ()
                runs.append(Run(start, end, meta.slot_list[i], meta.fresh_list[i], position,
                                run_saves))  # fmt: skip
        device = meta.slots.device
        if len(singles) == len(meta.slot_list):  # every sequence decodes one token
            rows, slots, fresh = None, meta.slots, meta.fresh
        else:
            index = torch.tensor(singles, dtype=torch.int64, device=device)
            rows = torch.tensor([qsl[i] for i in singles], dtype=torch.int64, device=device)
            slots, fresh = meta.slots.index_select(0, index), meta.fresh.index_select(0, index)
        keep = (~fresh).to(torch.float32)
        return cls(rows, slots, keep, tuple(runs), meta.snapshots)

    def save(self, layer_idx: int, spec: RecurrentState, run: Run,
             parts: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """Write a run's kept states into layer ``layer_idx``'s snapshot rows: ``parts``
        [len(run.saves), *part] per part of the layer's state, in ``spec.parts`` order."""
        assert self.snapshots is not None and run.saves
        snap = self.snapshots[layer_idx]
        assert snap is not None, f"layer {layer_idx} has no snapshot rows"
        rows = torch.tensor([r for _, r in run.saves], dtype=torch.int64, device=snap.device)
        for view, part in zip(spec.split(snap), parts):
            view.index_copy_(0, rows, part.to(view.dtype))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the one-token sequences' rows [B1, ...]."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write the one-token sequences' rows [B1, ...] into out [T, ...]."""
        if self.rows is None:
            out.copy_(values)
        else:
            out.index_copy_(0, self.rows, values)
