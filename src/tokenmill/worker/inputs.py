"""Host <-> device traffic of one step: one packed copy of the integer inputs up, the
sampled ids down.

On CUDA both directions go through pinned host buffers: the input copy is queued with
``non_blocking`` (the host goes on while it runs) and the step's one wait is for the
event recorded after its copies back (``record_event``). On CPU the same calls build
plain tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import add
from typing import TypeVar

import numpy as np
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.scheduler import ScheduledSeq, SchedulerOutput, SeqColumns
from tokenmill.scheduler.request import Request

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class StepColumns:
    """A step's sequences as the runner reads them: the scheduler's columns
    (``SeqColumns``) plus what input building, the fast paths' checks and the sampling
    rows derive from them, computed once per step. No object per sequence."""

    requests: tuple[Request, ...]
    """Each sequence's request: the rows of a decode step's sampling (the sampler's plan
    is keyed on them) and what tells a steady batch (the same requests, in order)."""
    starts: np.ndarray
    """[B] int64 position of each sequence's first new token."""
    num_new: np.ndarray
    """[B] int64 new tokens per sequence."""
    table_rows: list[int] | None
    """Each sequence's row of the scheduler's block-table array; None when one has none
    (steps built by hand): the tables come from the sequences' lists then."""
    width: int
    """Block-table columns the step needs (at least 1)."""
    one_token_each: bool
    """Every sequence computes one token and carries no drafts."""
    all_sample: bool
    """Every sequence samples (reaches its last token)."""
    decode_ids: list[int] | None
    """For a decode step: each sequence's input token on the host (0 where it is the
    placeholder of a token in flight); None otherwise."""
    pending: tuple[int, ...]
    """Sequences whose last input token is a placeholder (asynchronous scheduling)."""
    seq: SeqColumns
    """The scheduler's columns (samples, drafts and tree parents by sequence)."""

    @classmethod
    def of(cls, step: SchedulerOutput | Sequence[ScheduledSeq], block_size: int = 0) -> StepColumns:
        """The columns of a step (``block_size``: the KV block size, which sizes the
        block-table width from the sequences' ends; 0: from their tables' lengths)."""
        if isinstance(step, SchedulerOutput):
            c = step.cols
            seqs = None
        else:
            seqs = tuple(step)
            c = SeqColumns.of(seqs)
        b = len(c.requests)
        starts, num_new, rows = c.starts, c.num_new, c.table_rows
        has_rows = min(rows, default=0) >= 0
        one_each = not c.drafts and sum(num_new) == b
        if has_rows and block_size:  # each table holds the blocks its end needs
            width = -(-max(map(add, starts, num_new), default=0) // block_size)
        else:
            if seqs is None:
                seqs = step.seqs  # type: ignore[union-attr]
            width = max([len(s.block_table) for s in seqs], default=1)
        decode_ids = None
        requests = c.requests
        if one_each:
            # The token at ``start`` is the input; past the known tokens it is in flight.
            known = [len(r.all_token_ids) for r in requests]
            pending = tuple(i for i in range(b) if starts[i] >= known[i])
            decode_ids = [r.all_token_ids[s] if s < k else 0
                          for r, s, k in zip(requests, starts, known)]  # fmt: skip
        else:
            drafts = c.drafts
            pending = tuple(
                i for i in range(b)
                if starts[i] + num_new[i] - len(drafts.get(i, ())) > len(requests[i].all_token_ids)
            )  # fmt: skip
        return cls(
            requests=requests,
            starts=np.array(starts, dtype=np.int64),
            num_new=np.array(num_new, dtype=np.int64),
            table_rows=rows if has_rows else None,
            width=width or 1,
            one_token_each=one_each,
            all_sample=c.num_sampling == b,
            decode_ids=decode_ids,
            pending=pending,
            seq=c,
        )


class PinnedStaging:
    """A reusable int64 host buffer (pinned on CUDA) for one host-to-device copy at a time.

    ``host(n)`` hands out the array to fill, ``send`` copies it to the device. Before the
    buffer is handed out again, the event of its previous copy is waited on, so a copy
    still in flight (say from a step that raised) never reads half-new values. On CPU
    each ``host`` is a fresh array and ``send`` wraps it without a copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._done: torch.cuda.Event | None = None

    def host(self, n: int) -> np.ndarray:
        """An int64 [n] host array to fill, then pass to ``send``."""
        if not self.pinned:
            return np.empty(n, dtype=np.int64)
        if self._done is not None:
            self._done.synchronize()
        if n > self._host.numel():
            size = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return self._host.numpy()[:n]

    def send(self, host: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` (from ``host``) -> int64 [n] on the device; into ``out`` if given."""
        if not self.pinned:
            tensor = torch.from_numpy(host)
            return tensor if out is None else out.copy_(tensor)
        n = host.shape[0]
        if out is None:
            out = torch.empty(n, dtype=torch.int64, device=self.device)
        out.copy_(self._host[:n], non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return out


StepLike = SchedulerOutput | Sequence[ScheduledSeq]
"""A step as the scheduler gives it, or its sequences' records (built by hand in tests,
by the draft model's runner)."""


def records(step: StepLike) -> tuple[ScheduledSeq, ...]:
    """The step's ``ScheduledSeq`` records (made from the scheduler's columns if need be:
    only steps off the decode hot path ask)."""
    return step.seqs if isinstance(step, SchedulerOutput) else tuple(step)


def fill_block_tables(
    step: StepLike,
    tables: BlockTableArray | None,
    out: np.ndarray,
    rows: list[int] | None = None,
) -> None:
    """out [B, W] := each sequence's block table, 0-padded. One gather from the KV
    manager's array when the scheduler passed it (``rows``: the sequences' rows there,
    ``StepColumns.table_rows``); else (steps built by hand, in tests) from the
    per-sequence lists."""
    if tables is not None and rows is not None:
        tables.gather(rows, out)
        return
    out[:] = 0  # steps built by hand (``StepColumns.table_rows`` None): their own lists
    for i, s in enumerate(records(step)):
        table = s.block_table[: out.shape[1]]
        out[i, : len(table)] = table


class HostIds:
    """Where a step's sampled ids [N] int64 come back to the host.

    ``copy`` queues the copy: on CUDA into one of two pinned buffers, non-blocking (the
    caller records the step's event after all its copies and waits on that, not on the
    stream, so a step launched after it keeps the device busy). Two buffers: the copy of
    the step in flight never overwrites the one being read. On CPU the ids are returned.
    """

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self._hosts = [torch.empty(0, dtype=torch.int64) for _ in range(2)]
        self._turn = 0

    def copy(self, ids: torch.Tensor) -> torch.Tensor:
        """ids on the device -> the host tensor they land in (read after the step's event)."""
        if not self.pinned:
            return ids
        n = ids.numel()
        self._turn ^= 1
        if n > self._hosts[self._turn].numel():
            self._hosts[self._turn] = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        host = self._hosts[self._turn][:n]
        host.copy_(ids, non_blocking=True)
        return host


def record_event() -> torch.cuda.Event:
    """An event recorded now on the current stream: passed once everything queued so far
    (the step's kernels and its copies to the host) has run."""
    done = torch.cuda.Event()
    done.record()
    return done


@dataclass(frozen=True)
class PendingTokens:
    """Placeholder input tokens, known only on the device: sampled by the step still in
    flight (asynchronous scheduling). Each is the last new token of its sequence (a
    sequence with drafts is never scheduled while its step is in flight)."""

    source: torch.Tensor
    """[S] int64: the previous step's sampled ids (device)."""
    seqs: tuple[int, ...]
    """Indices (in this step) of the sequences whose last input token is pending."""
    rows: tuple[int, ...]
    """Their rows in ``source``."""

    def fill(
        self, input_ids: torch.Tensor, token_rows: torch.Tensor, src_rows: torch.Tensor
    ) -> None:
        """input_ids[token_rows] := source[src_rows] (device ops only; the index vectors
        came with the step's packed copy)."""
        input_ids[token_rows] = self.source[src_rows]


@dataclass(frozen=True)
class StepInputs:
    """A flattened batch on the device: T new tokens of B sequences."""

    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64."""
    meta: AttentionMetadata


def build_step_inputs(
    step: StepLike,
    block_size: int,
    staging: PinnedStaging,
    tables: BlockTableArray | None = None,
    pending: PendingTokens | None = None,
    cols: StepColumns | None = None,
) -> StepInputs:
    """Flatten the scheduled tokens; every integer tensor of the step comes from one copy of
    the packed host vector [ids T | positions T | slots T | seq_lens B | qsl B+1 | tables B*W
    | pending rows K | their source rows K] (block tables padded with 0 to the longest,
    W >= 1; each section at an even offset, see ``sections``), filled with numpy. Pending
    tokens go in as 0 and are filled on the device."""
    cols = cols or StepColumns.of(step, block_size)
    b = len(cols.requests)
    new, starts, width = cols.num_new, cols.starts, cols.width
    t = int(new.sum())
    k = len(pending.seqs) if pending is not None else 0
    sizes = [t, t, t, b, b + 1, b * width, k, k]
    host = staging.host(packed_numel(sizes))
    ids, pos, slots, lens, qsl, flat_tables, token_rows, src_rows = sections(host, sizes)
    if cols.decode_ids is not None:
        ids[:] = cols.decode_ids
    else:
        ids[:] = list(chain.from_iterable(known_tokens(s) for s in records(step)))
    qsl[0] = 0
    np.cumsum(new, out=qsl[1:])
    if cols.one_token_each:
        owner = np.arange(b)
        pos[:] = starts
    else:
        owner = np.repeat(np.arange(b), new)  # [T]: the sequence of each token
        pos[:] = np.arange(t) - qsl[owner] + starts[owner]
    table = flat_tables.reshape(b, width)
    fill_block_tables(step, tables, table, cols.table_rows)
    slots[:] = table[owner, pos // block_size] * block_size + pos % block_size
    lens[:] = starts + new
    if pending is not None:
        token_rows[:] = qsl[1:][list(pending.seqs)] - 1  # a pending token ends its chunk
        src_rows[:] = pending.rows
    packed = staging.send(host)
    ids_d, pos_d, slots_d, lens_d, qsl_d, tables_d, rows_d, src_d = sections(packed, sizes)
    if pending is not None:
        pending.fill(ids_d, rows_d, src_d)
    meta = AttentionMetadata(
        slot_mapping=slots_d,
        query_start_loc=tuple(qsl.tolist()),
        seq_lens=tuple(lens.tolist()),
        block_tables=tables_d.view(b, width),
        block_size=block_size,
        seq_lens_tensor=lens_d,
        # Read only by the reference backend's per-sequence path (prefill chunks).
        first_block_if_contiguous=() if t == b else _first_if_contiguous(table, lens, block_size),
        query_start_loc_tensor=qsl_d,  # a view of the packed copy: no extra op
    )
    return StepInputs(ids_d, pos_d, meta)


def _even(n: int) -> int:
    return n + (n & 1)


def packed_numel(sizes: Sequence[int]) -> int:
    """Elements of a packed vector holding sections of these sizes (``sections``)."""
    return sum(_even(size) for size in sizes)


def sections(packed: ArrayT, sizes: Sequence[int]) -> list[ArrayT]:
    """Views of the sections of a packed int64 vector (a host array or its device copy).

    Each section starts at an even element, so every device view is 16-byte aligned:
    Triton compiles one variant of a kernel per pointer alignment, and odd section sizes
    (T tokens, B + 1 offsets...) would make that flip from step to step. Slicing, not
    np.split or Tensor.split: ~10 us less, which matters at batch 1."""
    out, start = [], 0
    for size in sizes:
        out.append(packed[start : start + size])
        start += _even(size)
    return out


def known_tokens(s: ScheduledSeq) -> list[int]:
    """The chunk's input tokens on the host: the sequence's known tokens, 0 for a
    placeholder (the previous step's sampled token, still on the device: ``PendingTokens``),
    then the drafts to verify."""
    drafts = s.draft_token_ids
    if not drafts:  # the common case, kept short: built per sequence per step
        tokens = s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
        if len(tokens) == s.num_new_tokens:
            return tokens
        assert len(tokens) == s.num_new_tokens - 1, "only the last input token can be pending"
        return [*tokens, 0]
    base_end = s.end - len(drafts)
    tokens = s.request.all_token_ids[s.start : base_end]
    missing = base_end - s.start - len(tokens)
    if not missing and not drafts:
        return tokens
    assert missing <= 1 and not (missing and drafts), "one placeholder, last, and no drafts"
    return [*tokens, *([0] * missing), *drafts]


def _first_if_contiguous(
    table: np.ndarray, lens: np.ndarray, block_size: int
) -> tuple[int | None, ...]:
    """Per row of table [B, W]: its first block id when the blocks its lens[i] tokens use
    are consecutive ids, else None (``attention.metadata._first_if_contiguous``, batched)."""
    used = -(-lens // block_size)  # [B]
    j = np.arange(table.shape[1])
    beyond = j[None, :] >= used[:, None]
    ok = ((table == table[:, :1] + j) | beyond).all(axis=1) & (used > 0)
    return tuple(first if o else None for first, o in zip(table[:, 0].tolist(), ok.tolist()))
