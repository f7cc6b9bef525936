"""The sampler's persistent view of a batch: what each row needs, worked out once.

A decode batch is the same requests step after step (until one arrives or ends), so the
per-row questions the sampler asks (greedy or random? which processors touch it? which
filters? seeded? logprobs?) have the same answers every step. ``SamplingPlan`` holds the
answers for one batch composition: index tuples per row processor, the random rows and
their parameter tensors (already on the device), the seeded rows, the largest logprobs.
``PlanCache`` keeps the last plan and hands it back while the rows are the same objects
in the same order (a tuple comparison by identity, ~3 us at 256 rows), so a steady batch
walks its rows in Python only when it changes.

What still varies per step is handled per step, but only for the rows concerned:
min_tokens' count (its processor checks its own rows), seeded rows' positions
(``Sampler._exponential``), tokens in flight (``InFlightRow``, equal to its request's row
here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.sampling.logits_processors import LogitsProcessor, RowProcessor, upload

if TYPE_CHECKING:
    from tokenmill.sampling.sampler import SamplingRow


Processor = RowProcessor | LogitsProcessor


@dataclass(frozen=True)
class RandomRows:
    """The rows that sample (temperature > 0) and their filters' parameters [S] on the
    device; None where no random row uses that filter."""

    index: tuple[int, ...]
    index_tensor: torch.Tensor | None
    """[S] int64 rows in the batch; None when every row is random (no gather)."""
    temperature: torch.Tensor | None
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    seeded: tuple[int, ...]
    """Positions (in ``index``) of the seeded rows: their noise comes from their own
    generator, re-seeded per step for the token's position."""
    unseeded: torch.Tensor | None
    """[U] int64 positions (in ``index``) of the others when both kinds are present."""


@dataclass(frozen=True)
class SamplingPlan:
    rows: tuple[SamplingRow, ...]
    """The rows the plan was made for (its cache key)."""
    only: tuple[tuple[int, ...] | None, ...]
    """Per processor of the sampler: the rows it touches (empty: skipped), or None for a
    plain ``LogitsProcessor`` (called with every row)."""
    random: RandomRows | None
    """None: every row is greedy (one argmax)."""
    max_logprobs: int | None


def make_plan(
    rows: Sequence[SamplingRow], processors: Sequence[Processor], device: torch.device
) -> SamplingPlan:
    """Walk the rows once: which processors touch which rows, the random rows' filters."""
    only = tuple(
        tuple(i for i, row in enumerate(rows) if p.needs(row))
        if isinstance(p, RowProcessor)
        else None
        for p in processors
    )
    params = [row.params for row in rows]
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingPlan(tuple(rows), only, _random_rows(rows, device), max(asked, default=None))


def _random_rows(rows: Sequence[SamplingRow], device: torch.device) -> RandomRows | None:
    index = tuple(i for i, row in enumerate(rows) if not row.params.is_greedy)
    if not index:
        return None
    params = [rows[i].params for i in index]
    seeded = tuple(j for j, i in enumerate(index) if rows[i].generator is not None)
    assert all(rows[i].generator is not None or rows[i].params.seed is None for i in index), (
        "a seeded row without its generator"
    )

    def tensor(values: list, dtype: torch.dtype, used: bool) -> torch.Tensor | None:
        return upload(values, dtype, device) if used else None

    return RandomRows(
        index=index,
        index_tensor=None if len(index) == len(rows) else upload(index, torch.int64, device),
        temperature=tensor(
            [p.temperature for p in params],
            torch.float32,
            any(p.temperature != 1.0 for p in params),
        ),
        min_p=tensor([p.min_p for p in params], torch.float32, any(p.min_p > 0 for p in params)),
        # top_k as given (0 = off); the sampler clamps it to the vocabulary.
        top_k=tensor([p.top_k for p in params], torch.int64, any(p.top_k > 0 for p in params)),
        top_p=tensor([p.top_p for p in params], torch.float32, any(p.top_p < 1.0 for p in params)),
        seeded=seeded,
        unseeded=(
            upload([j for j in range(len(index)) if j not in set(seeded)], torch.int64, device)
            if seeded and len(seeded) < len(index)
            else None
        ),
    )


class PlanCache:
    """The last plan, reused while the batch's rows are the same objects in the same order."""

    def __init__(self) -> None:
        self._plan: SamplingPlan | None = None
        self.num_built = 0
        """Plans made so far (how often the batch changed)."""

    def get(
        self, rows: Sequence[SamplingRow], processors: Sequence[Processor], device: torch.device
    ) -> SamplingPlan:
        plan = self._plan
        key = rows if isinstance(rows, tuple) else tuple(rows)
        if plan is None or plan.rows != key:
            plan = self._plan = make_plan(key, processors, device)
            self.num_built += 1
        return plan
