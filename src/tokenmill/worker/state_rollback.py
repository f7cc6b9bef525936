"""Rolling a recurrent state back to the accepted drafts of a verify step.

A verify step runs 1 + k tokens of a sequence (its last known token, then k drafts)
through every layer. Rejected K/V of the attention layers rolls back by itself (the
scheduler truncates the blocks and ``num_computed_tokens``; the next step overwrites the
positions), but a recurrent layer's slot holds one state, the one after all 1 + k tokens.

Design: **per-position states, no recompute.** The verify run's recurrent layers keep,
next to the final state in the slot, the states after the last known token and after
each draft but the last (k states: conv window and SSM / delta state, the slot's packing)
in this step's *rollback rows* (``layers/recurrent/plan.Run.keeps``). Once the sampler
has accepted n drafts (``apply``, at the step's collect, before the scheduler reads
anything), the row of n is copied into the slot when n < k; n = k leaves the slot as it
is. Why not save the state before the step and recompute the accepted prefix: that is a
second forward of every layer for 1 + n tokens per rejection (most steps reject
something), where keeping costs a copy of k states per layer and one small product per
kept position in the scan (``delta_rule.partial_state``, ``ssd.partial_state``); the
memory is k slots per speculating sequence for one step. The conv window (the last
K - 1 inputs) is part of the slot, so it rolls back with the same copy.

Rows are taken per step from ``RollbackRows`` (tensors kept between steps, grown when a
step needs more: no page faults of fresh buffers every step) and given back at collect;
with asynchronous scheduling two steps may hold rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.kv_cache.spec import RecurrentState


@dataclass(frozen=True)
class StateRollback:
    """One verify step's rollback rows: sequence ``seqs[j]`` (its index in the step) has
    ``num_drafts[j]`` rows from ``first_rows[j]``; row first + n holds the state after
    its last known token and n drafts."""

    seqs: tuple[int, ...]
    first_rows: tuple[int, ...]
    num_drafts: tuple[int, ...]
    tensors: list[torch.Tensor | None]
    """Per layer [rows, *slot shape] (None for layers without a recurrent state)."""
    run_keeps: tuple[tuple[tuple[int, int], ...], ...]
    """Per sequence of the step, (tokens into its run, row) to keep (``StateMetadata``)."""

    def apply(
        self,
        slots: Sequence[int],
        accepted: Sequence[int | None],
        caches: Sequence[torch.Tensor | None],
    ) -> RollbackCopies:
        """Copy, per layer in one ``index_copy_``, the row of each sequence's accepted
        drafts into its slot. ``slots[i]``, ``accepted[i]`` (None: leave it, the request
        was preempted or ended while the step was in flight) per sequence of the step.
        Returns the copies made (a parallel run's workers make them on their shards)."""
        rows: list[int] = []
        dest: list[int] = []
        for i, first, k in zip(self.seqs, self.first_rows, self.num_drafts):
            n = accepted[i]
            if n is not None and n < k:
                rows.append(first + n)
                dest.append(slots[i])
        copies = RollbackCopies(tuple(rows), tuple(dest))
        copy_rows(self.tensors, caches, copies)
        return copies


@dataclass(frozen=True)
class RollbackCopies:
    """One verify step's copies: rollback row ``rows[j]`` into state slot ``slots[j]``."""

    rows: tuple[int, ...]
    slots: tuple[int, ...]


def copy_rows(
    kept: Sequence[torch.Tensor | None],
    caches: Sequence[torch.Tensor | None],
    copies: RollbackCopies,
) -> None:
    """Each layer's kept rows into its slots, one ``index_copy_`` per layer."""
    if not copies.rows:
        return
    device = next(t.device for t in kept if t is not None)
    row_t = torch.tensor(copies.rows, dtype=torch.int64, device=device)
    slot_t = torch.tensor(copies.slots, dtype=torch.int64, device=device)
    for rows, cache in zip(kept, caches):
        if rows is not None and cache is not None:
            cache.index_copy_(0, slot_t, rows.index_select(0, row_t))


class RollbackRows:
    """Per-step rollback rows for a model's recurrent layers (``take`` / ``give``)."""

    def __init__(self, specs: Sequence[object], caches: Sequence[torch.Tensor | None]) -> None:
        self._layers = [
            (i, cache) for i, (spec, cache) in enumerate(zip(specs, caches))
            if isinstance(spec, RecurrentState) and cache is not None
        ]  # fmt: skip
        self._num_layers = len(specs)
        self._free: list[list[torch.Tensor | None]] = []

    def plan(self, drafts: dict[int, tuple[int, ...]], num_new: Sequence[int],
             num_seqs: int) -> StateRollback | None:  # fmt: skip
        """The rows and keeps of a step whose sequences ``drafts`` verify drafts (sequence
        i runs ``num_new[i]`` tokens, the last len(drafts[i]) of them drafts); None when
        none does."""
        if not self._layers:  # state slots without a recurrent state: nothing to roll back
            return None
        seqs, firsts, counts = [], [], []
        keeps: list[tuple[tuple[int, int], ...]] = [()] * num_seqs
        total = 0
        for i, d in sorted(drafts.items()):
            k, length = len(d), num_new[i]
            seqs.append(i)
            firsts.append(total)
            counts.append(k)
            # after the last known token (length - k of the run) and each draft but the last
            keeps[i] = tuple((length - k + n, total + n) for n in range(k))
            total += k
        if not total:
            return None
        return StateRollback(tuple(seqs), tuple(firsts), tuple(counts), self.take(total),
                             tuple(keeps))  # fmt: skip

    def give(self, tensors: list[torch.Tensor | None]) -> None:
        """The step was collected: its rows may serve a later step."""
        if len(self._free) < 2:  # the step in flight and the one just launched
            self._free.append(tensors)

    def take(self, rows: int) -> list[torch.Tensor | None]:
        """Per layer [>= rows, *slot shape] (None for layers without a recurrent state)."""
        for j, held in enumerate(self._free):
            if _capacity(held) >= rows:
                return self._free.pop(j)
        self._free.clear()  # each is too small: let them go
        tensors: list[torch.Tensor | None] = [None] * self._num_layers
        for i, cache in self._layers:
            tensors[i] = torch.empty((rows, *cache.shape[1:]), dtype=cache.dtype,
                                     device=cache.device)  # fmt: skip
        return tensors


def _capacity(tensors: list[torch.Tensor | None]) -> int:
    return next(t.shape[0] for t in tensors if t is not None)
