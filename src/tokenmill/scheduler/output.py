"""What the scheduler decided for one step: the only thing the model runner reads.

A step is built as columns (``SeqColumns``: one list per field, appended to in the
scheduler's loop), not as one object per sequence: at 256 decoding sequences the objects
cost the host more than the rest of the scheduling. ``ScheduledSeq`` records are made
from the columns only when something asks for ``SchedulerOutput.seqs`` (steps with
drafts, media, prompt chunks read by hand, tests); the decode hot path reads columns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.scheduler.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + num_new_tokens) of it.

    Read-only by convention, not frozen. Made on demand from ``SeqColumns`` (or by hand,
    in tests and by the draft model's runner).
    """

    request: Request
    start: int
    """Position of the first new token (= num_computed_tokens before this step)."""
    num_new_tokens: int
    block_table: Sequence[int]
    """The request's block ids (the KV manager's live list: valid for this step)."""
    samples: bool
    """True when this chunk reaches the request's last known token: sample the next (and
    verify the drafts, if any)."""
    table_row: int = -1
    """The same table as row ``table_row`` of ``SchedulerOutput.tables`` (-1: none)."""
    draft_token_ids: tuple[int, ...] = ()
    """Draft tokens to verify: the last len(draft_token_ids) of the new tokens. The step
    samples at each of them and after the last (drafts + 1 logits rows)."""
    draft_parents: tuple[int, ...] = ()
    """A draft tree's parent of each draft (-1: the last known token,
    ``worker/draft_tree.py``); empty: the drafts are a chain."""

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_sample_rows(self) -> int:
        """Logits rows this sequence samples: drafts + 1, or 0."""
        return len(self.draft_token_ids) + 1 if self.samples else 0


@dataclass(frozen=True, slots=True)
class SeqColumns:
    """A step's B sequences as parallel columns, in scheduled order."""

    requests: tuple[Request, ...]
    starts: list[int]
    """[B] position of each sequence's first new token."""
    num_new: list[int]
    """[B] new tokens per sequence."""
    table_rows: list[int]
    """[B] each sequence's row of the scheduler's block-table array (-1: none, in steps
    built by hand; their tables are then the sequences' own lists)."""
    samples: list[bool]
    """[B] whether the chunk reaches the last known token (``ScheduledSeq.samples``)."""
    drafts: dict[int, tuple[int, ...]]
    """Sequence index -> its draft tokens, for the sequences that carry drafts only."""
    parents: dict[int, tuple[int, ...]]
    """Sequence index -> its draft tree's parents, for tree drafts only."""
    num_sampling: int
    """How many sequences sample."""

    @classmethod
    def of(cls, seqs: Sequence[ScheduledSeq]) -> SeqColumns:
        samples = [s.samples for s in seqs]
        return cls(
            requests=tuple([s.request for s in seqs]),
            starts=[s.start for s in seqs],
            num_new=[s.num_new_tokens for s in seqs],
            table_rows=[s.table_row for s in seqs],
            samples=samples,
            drafts={i: s.draft_token_ids for i, s in enumerate(seqs) if s.draft_token_ids},
            parents={i: s.draft_parents for i, s in enumerate(seqs) if s.draft_parents},
            num_sampling=sum(samples),
        )

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token, samples after it, and has no drafts."""
        b = len(self.requests)
        return self.num_sampling == b and not self.drafts and sum(self.num_new) == b


class SchedulerOutput:
    """One step: its sequences (as ``cols``, or as ``seqs`` records; either is made from
    the other on first use), the requests preempted while scheduling it, the block-table
    array, and the requests scheduled for the first time (an event record for metrics)."""

    __slots__ = ("_seqs", "_cols", "preempted", "tables", "first_scheduled", "_table_of")

    def __init__(
        self,
        seqs: Sequence[ScheduledSeq] | None = None,
        preempted: tuple[str, ...] = (),
        tables: BlockTableArray | None = None,
        first_scheduled: tuple[Request, ...] = (),
        *,
        cols: SeqColumns | None = None,
        table_of: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        assert (seqs is None) != (cols is None), "a step is given as records or as columns"
        self._seqs = tuple(seqs) if seqs is not None else None
        self._cols = cols
        self.preempted = preempted
        self.tables = tables
        """Every block table as a row of one array: the runner gathers the step's rows."""
        self.first_scheduled = first_scheduled
        """Event record: the requests scheduled for the first time in this step."""
        self._table_of = table_of
        """Request id -> its live block list (the KV manager's), for records made later."""

    @property
    def cols(self) -> SeqColumns:
        if self._cols is None:
            assert self._seqs is not None
            self._cols = SeqColumns.of(self._seqs)
        return self._cols

    @property
    def seqs(self) -> tuple[ScheduledSeq, ...]:
        """The sequences as records (made from the columns once, on first use)."""
        if self._seqs is None:
            self._seqs = self._records()
        return self._seqs

    def _records(self) -> tuple[ScheduledSeq, ...]:
        c = self.cols
        table_of = self._table_of
        return tuple(
            ScheduledSeq(
                req,
                start,
                n,
                table_of(req.request_id) if table_of else [],
                samples,
                row,
                c.drafts.get(i, ()),
                c.parents.get(i, ()),
            )  # fmt: skip
            for i, (req, start, n, samples, row) in enumerate(
                zip(c.requests, c.starts, c.num_new, c.samples, c.table_rows)
            )
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.cols.num_new)

    @property
    def is_empty(self) -> bool:
        return not self.cols.requests

    @property
    def has_drafts(self) -> bool:
        return bool(self.cols.drafts)


class StepTokens(Sequence[list[int]]):
    """A step's new tokens, per sequence in scheduled order. A decode step (one token per
    sequence) keeps them as one flat list (``flat``), read so by ``Scheduler.update``;
    other steps hold a list per sequence. Either reads as a sequence of lists."""

    __slots__ = ("flat", "_lists")

    def __init__(self, lists: list[list[int]] | None = None, flat: list[int] | None = None) -> None:
        assert (lists is None) != (flat is None)
        self.flat = flat
        self._lists = lists

    def __len__(self) -> int:
        return len(self._lists if self._lists is not None else self.flat)  # type: ignore[arg-type]

    def __getitem__(self, i):  # type: ignore[override]
        if self._lists is not None:
            return self._lists[i]
        assert self.flat is not None
        if isinstance(i, slice):
            return [[t] for t in self.flat[i]]
        return [self.flat[i]]

    def __iter__(self) -> Iterator[list[int]]:
        if self._lists is not None:
            return iter(self._lists)
        assert self.flat is not None
        return ([t] for t in self.flat)

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"StepTokens({list(self)!r})"
