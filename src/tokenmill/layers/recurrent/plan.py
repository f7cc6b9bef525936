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
    (``kv_cache/snapshots.py``): interval ones at a multiple of the scans' chunk, so the
    scan, aligned to absolute positions (``lead``), reaches them at its own chunk ends;
    a prompt's last token but one anywhere (one small product, as ``keeps``)."""
    keeps: tuple[tuple[int, int], ...] = ()
    """(tokens into the run, rollback row) of the states a verify step keeps
    (``worker/state_rollback.py``): after the last known token and after each draft but
    the last, anywhere in a chunk (the scans cut their chunk there)."""

    def lead(self, chunk: int) -> int:
        """Tokens of padding before the run that align a scan's chunks to absolute
        positions (0 without snapshots: the scan runs as without them)."""
        return self.position % chunk if self.saves else 0

    def chunk(self, chunk: int) -> int:
        """The scans' chunk for this run: ``chunk``, but a short verify run (drafts, no
        snapshot) is one chunk of its own length (padding 1 + k tokens to 64 would cost
        more than the step)."""
        return min(chunk, self.end - self.start) if self.keeps and not self.saves else chunk

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where states are kept: the snapshots', then the rollback's."""
        return tuple(o for o, _ in (*self.saves, *self.keeps))


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
    rollback: Sequence[torch.Tensor | None] | None = None
    """Each layer's rollback rows (``StateMetadata.rollback``), for the runs' keeps."""

    @property
    def num_singles(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def of(cls, ctx: StepContext) -> StatePlan:
        meta, qsl = ctx.state, ctx.attn.query_start_loc
        assert meta is not None, "recurrent layers need the step's state slots"
        singles: list[int] = []
        runs: list[Run] = []
        seq_lens, saves, keeps = ctx.attn.seq_lens, meta.run_saves, meta.run_keeps
        for i, (start, end) in enumerate(zip(qsl, qsl[1:])):
            if end - start == 1:
                singles.append(i)
            elif end > start:
                position = seq_lens[i] - (end - start)
                run_saves = saves[i] if saves else ()
                run_keeps = keeps[i] if keeps else ()
                runs.append(Run(start, end, meta.slot_list[i], meta.fresh_list[i], position,
                                run_saves, run_keeps))  # fmt: skip
        device = meta.slots.device
        if len(singles) == len(meta.slot_list):  # every sequence decodes one token
            rows, slots, fresh = None, meta.slots, meta.fresh
        else:
            index = torch.tensor(singles, dtype=torch.int64, device=device)
            rows = torch.tensor([qsl[i] for i in singles], dtype=torch.int64, device=device)
            slots, fresh = meta.slots.index_select(0, index), meta.fresh.index_select(0, index)
        keep = (~fresh).to(torch.float32)
        return cls(rows, slots, keep, tuple(runs), meta.snapshots, meta.rollback)

    def save(self, layer_idx: int, spec: RecurrentState, run: Run,
             parts: Sequence[torch.Tensor]) -> None:  # fmt: skip
        """Write a run's kept states (``parts`` [len(run.offsets), *part] per part of the
        layer's state, in ``spec.parts`` order): the first len(run.saves) into layer
        ``layer_idx``'s snapshot rows, the rest into its rollback rows."""
        n = len(run.saves)
        if n:
            assert self.snapshots is not None
            _write(self.snapshots[layer_idx], spec, run.saves, [p[:n] for p in parts])
        if run.keeps:
            assert self.rollback is not None
            _write(self.rollback[layer_idx], spec, run.keeps, [p[n:] for p in parts])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> the one-token sequences' rows [B1, ...]."""
        return x if self.rows is None else x.index_select(0, self.rows)

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write the one-token sequences' rows [B1, ...] into out [T, ...]."""
        if self.rows is None:
            out.copy_(values)
        else:
            out.index_copy_(0, self.rows, values)


def _write(rows_of: torch.Tensor | None, spec: RecurrentState,
           where: tuple[tuple[int, int], ...], parts: Sequence[torch.Tensor]) -> None:  # fmt: skip
    """parts[i] [len(where), *part i] -> rows (the second of each pair) of ``rows_of``
    [rows, *slot shape], a layer's snapshot or rollback rows."""
    assert rows_of is not None, "a recurrent layer has no rows to keep states in"
    rows = torch.tensor([r for _, r in where], dtype=torch.int64, device=rows_of.device)
    for view, part in zip(spec.split(rows_of), parts):
        view.index_copy_(0, rows, part.to(view.dtype))
