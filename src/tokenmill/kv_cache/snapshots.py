"""Recurrent-state snapshots: where a later request can resume a hybrid model's prompt.

A recurrent layer's state after tokens [0, p) can not be rebuilt from cached KV blocks,
so prefix caching of hybrid and state-space models keeps copies of it: a pool of
snapshot rows under a byte budget (``context_cache_config={"recurrent_snapshot_pool_bytes":
...}``), least recently used evicted first. A row holds every recurrent layer's state at
one position p and, for a p inside a block, the paged layers' K/V of that partial block
(the *tail*: full blocks are already in the prefix cache). A hit restores the blocks
[0, p // block_size) from the prefix cache, the tail into a new block and the state into
the request's slot, and computes from p.

Where snapshots are taken (the coordinator reserves rows as it schedules, ``reserve``):

- at every ``interval`` tokens (a multiple of the block size and of the scans' 64-token
  chunk): inside a prefill chunk the recurrent layers keep the state their chunked scan
  reaches there (aligned to absolute positions, so it is one of the scan's own chunk
  ends: no extra compute, one copy), and a decode that ends there is copied after its
  step. Intermediate states are taken from the scan rather than only where a forward
  ended, because chunk ends fall wherever the token budget cut: a shared 300-token prefix
  inside a 310-token prompt prefilled in one chunk would otherwise leave nothing to resume;
- one token before the end of every prompt, and of a recomputed request's known tokens
  (token-granular: short prompts, chat turns and the same prompt again hit too; a hit must
  leave a token to compute for the logits, so a snapshot at the end itself would serve
  only longer prompts, and one a token earlier serves those for one token more). Inside
  a prefill chunk the scans give that state from their chunk's start state with one
  small product (``partial_state``), and the runner copies the partial block's K/V.

Host bookkeeping only: the tensors live in the runner (``snapshot_copies.py``), which
does a step's copies in one batched copy per layer. A reserved row is written by the step
that reserved it and becomes findable when the scheduler commits that step (its key needs
the tokens, which asynchronous scheduling knows only then).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache.spec import CacheSpec, bytes_per_block, state_bytes_per_slot

SCAN_CHUNK = 64
"""The chunked scans' chunk (``layers/recurrent/delta_rule.CHUNK``, ``ssd.CHUNK``): an
interval position must be one of their chunk ends to be taken from inside a scan."""


@dataclass(frozen=True)
class ContextCacheConfig:
    """``context_cache_config``: how hybrid models' prompts are kept for reuse."""

    recurrent_snapshot_pool_bytes: int | None = None
    """Byte budget of the recurrent-state snapshot pool (0: no snapshots, a hybrid model
    then reuses no prefix); None: as many bytes as the live state slots take."""

    @classmethod
    def parse(
        cls, options: Mapping[str, Any] | None, flat: int | None = None
    ) -> ContextCacheConfig:
        """From the dict (and the flat ``recurrent_snapshot_pool_bytes`` option); raises
        ``InvalidRequestError`` (a ValueError) on unknown keys, both forms, or a budget that is not an integer >= 0."""
        options = dict(options or {})
        unknown = sorted(set(options) - {"recurrent_snapshot_pool_bytes"})
        if unknown:
            raise InvalidRequestError(
                f"context_cache_config has unknown keys {unknown}; the known key is "
                "recurrent_snapshot_pool_bytes"
            )
        budget = options.get("recurrent_snapshot_pool_bytes")
        if budget is not None and flat is not None:
            raise InvalidRequestError(
                "recurrent_snapshot_pool_bytes is given twice (in context_cache_config and "
                "as its own option); give one"
            )
        budget = flat if budget is None else budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):  # fmt: skip
            raise InvalidRequestError(
                f"recurrent_snapshot_pool_bytes must be an integer >= 0 (bytes; 0 turns "
                f"snapshots off), got {budget!r}"
            )
        return cls(budget)


def row_bytes(specs: Sequence[CacheSpec], block_size: int) -> int:
    """Bytes of one snapshot row: every recurrent layer's state and a block of every
    paged layer's K/V (the tail)."""
    return state_bytes_per_slot(specs) + bytes_per_block(specs, block_size)


def snapshot_rows(
    specs: Sequence[CacheSpec], block_size: int, budget: int | None, num_slots: int
) -> int:
    """Rows the budget holds (None: the state slot pool's bytes); 0 without recurrent
    layers (nothing to snapshot) or with a budget of 0."""
    if state_bytes_per_slot(specs) == 0:
        return 0
    if budget is None:
        budget = num_slots * state_bytes_per_slot(specs)
    return budget // row_bytes(specs, block_size)


def checkpoint_interval(block_size: int) -> int:
    """Tokens between interval snapshots: the least multiple of the block size and of the
    scans' chunk (64 for blocks of 4 or 16)."""
    return math.lcm(block_size, SCAN_CHUNK)


@dataclass(frozen=True)
class SnapshotKey:
    """Position p = the ``parent``'s blocks + len(tail): the chain hash of the last full
    block before p (b"" at the start), the extra key of p's block, the tokens after it."""

    parent: bytes
    extra: bytes
    tail: tuple[int, ...]


@dataclass(frozen=True)
class StateStep:
    """What the runner does with state slots and snapshots in one step (from
    ``KVCacheCoordinator.state_step``)."""

    slots: tuple[int, ...]
    """Each sequence's state slot."""
    run_saves: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per sequence, (tokens into its chunk, row) of the states its layers keep inside the
    chunk (() for every sequence when none)."""
    restore_rows: tuple[int, ...] = ()
    """Before the forward: row -> slot (the state) and row -> block (the tail; -1: none)."""
    restore_slots: tuple[int, ...] = ()
    restore_blocks: tuple[int, ...] = ()
    save_rows: tuple[int, ...] = ()
    """After the forward: slot -> row, block -> row's tail (-1: none)."""
    save_slots: tuple[int, ...] = ()
    save_blocks: tuple[int, ...] = ()
    tail_rows: tuple[int, ...] = ()
    """After the forward, block -> row's tail only, for states kept inside a chunk (in
    ``run_saves``) at a position inside a block (a prompt's last token but one)."""
    tail_blocks: tuple[int, ...] = ()

    @property
    def saves_after(self) -> bool:
        """Whether anything is copied after the forward."""
        return bool(self.save_rows or self.tail_rows)


@dataclass
class SnapshotStats:
    """Cumulative counters (``prefix_cache_metrics``)."""

    restores: int = 0
    """Admissions that resumed from a snapshot."""
    hit_tokens: int = 0
    """Tokens not recomputed thanks to them."""
    saves: int = 0
    """Snapshots written and committed."""
    evictions: int = 0


@dataclass
class _Pending:
    position: int
    row: int


@dataclass
class SnapshotPool:
    """Rows 0..num_rows-1: free, reserved by a request (written by a step, not yet
    committed), or committed under a key (findable, LRU-ordered, maybe pinned by a
    restore not yet copied)."""

    num_rows: int
    row_bytes: int
    stats: SnapshotStats = field(default_factory=SnapshotStats)

    def __post_init__(self) -> None:
        self._free = list(range(self.num_rows - 1, -1, -1))  # pop() -> row 0 first
        self._lru: OrderedDict[int, SnapshotKey] = OrderedDict()  # committed, oldest first
        self._by_parent: dict[bytes, dict[tuple[bytes, tuple[int, ...]], int]] = {}
        self._pins: dict[int, int] = {}
        self._pending: dict[str, list[_Pending]] = {}

    @property
    def num_committed(self) -> int:
        return len(self._lru)

    @property
    def held_bytes(self) -> int:
        """Bytes of the rows that hold a snapshot (committed or being written)."""
        return (self.num_rows - len(self._free)) * self.row_bytes

    # -- lookup and restore -------------------------------------------------------------
    def find(
        self, parents: Sequence[bytes], token_ids: Sequence[int], block_size: int,
        extra: Callable[[int], bytes],
    ) -> tuple[int, int] | None:  # fmt: skip
        """The longest snapshot of a prefix of ``token_ids`` leaving a token to compute,
        given the verified cached blocks' chain hashes ``parents`` (blocks 0..k-1) and
        ``extra(i)``, block i's extra key: (position, row), or None. Searched from the
        last cached block down: a prefix without a snapshot at its end falls back to the
        longest one that has one."""
        for k in range(len(parents), -1, -1):
            entries = self._by_parent.get(parents[k - 1] if k else b"")
            if not entries:
                continue
            start, best = k * block_size, None
            for (key_extra, tail), row in entries.items():
                end = start + len(tail)
                if end >= len(token_ids) or (best is not None and end <= best[0]):
                    continue
                if key_extra == extra(k) and tuple(token_ids[start:end]) == tail:
                    best = (end, row)
            if best is not None and best[0] > 0:
                self._lru.move_to_end(best[1])
                return best
        return None

    def pin(self, row: int) -> None:
        """Keep a committed row from eviction until its restore is copied (``unpin``)."""
        self._pins[row] = self._pins.get(row, 0) + 1

    def pinned_rows(self) -> list[int]:
        """Each pinned row once per pin."""
        return [row for row, n in self._pins.items() for _ in range(n)]

    def unpin(self, row: int) -> None:
        left = self._pins.pop(row) - 1
        if left:
            self._pins[row] = left

    # -- saving -------------------------------------------------------------------------
    def reserve(self, request_id: str, position: int) -> int | None:
        """A row for the request's state at ``position`` (written by the step being
        scheduled): a free row, else the least recently used unpinned committed one;
        None when every row is reserved or pinned (no snapshot then)."""
        pending = self._pending.setdefault(request_id, [])
        if any(p.position == position for p in pending):
            return None
        row = self._take_row()
        if row is not None:
            pending.append(_Pending(position, row))
        return row

    def _take_row(self) -> int | None:
        if self._free:
            return self._free.pop()
        for row in self._lru:
            if row not in self._pins:
                self._drop(row)
                self.stats.evictions += 1
                return self._free.pop()
        return None

    def commit(self, request_id: str, upto: int, limit: int, key_of) -> None:
        """Make the request's rows written by now (position <= ``upto``) findable under
        ``key_of(position)``; those past ``limit`` (tokens that may not be cached) go back."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        keep = []
        for p in pending:
            if p.position > upto:
                keep.append(p)
            elif p.position > limit:
                self._release(p.row)
            else:
                self._insert(key_of(p.position), p.row)
        self._pending[request_id] = keep

    def _insert(self, key: SnapshotKey, row: int) -> None:
        entries = self._by_parent.setdefault(key.parent, {})
        old = entries.get((key.extra, key.tail))
        if old is not None:  # the same prefix twice: keep the older row, mark it used
            self._lru.move_to_end(old)
            self._release(row)
            return
        entries[(key.extra, key.tail)] = row
        self._lru[row] = key
        self.stats.saves += 1

    def discard_after(self, request_id: str, position: int) -> None:
        """The request rolled back to ``position`` tokens (rejected drafts): its rows past
        it hold states of tokens it no longer has and go back (positions reached again
        are reserved again)."""
        pending = self._pending.get(request_id)
        if not pending:
            return
        for p in pending:
            if p.position > position:
                self._release(p.row)
        self._pending[request_id] = [p for p in pending if p.position <= position]

    def discard(self, request_id: str) -> None:
        """The request ended (finish, abort, preemption): its unwritten or uncommitted
        rows go back (a step in flight may still write them: a later reservation's step
        writes after it)."""
        for p in self._pending.pop(request_id, ()):
            self._release(p.row)

    def _drop(self, row: int) -> None:
        key = self._lru.pop(row)
        entries = self._by_parent[key.parent]
        del entries[(key.extra, key.tail)]
        if not entries:
            del self._by_parent[key.parent]
        self._free.append(row)

    def _release(self, row: int) -> None:
        self._free.append(row)

    def reset(self) -> int:
        """Forget every committed, unpinned snapshot; returns how many."""
        rows = [r for r in self._lru if r not in self._pins]
        for row in rows:
            self._drop(row)
        return len(rows)

    def check_integrity(self) -> None:
        """Every row is free xor reserved xor committed; the index and the LRU agree."""
        reserved = [p.row for ps in self._pending.values() for p in ps]
        rows = [*self._free, *reserved, *self._lru]
        assert len(rows) == len(set(rows)) == self.num_rows, "a snapshot row is lost or shared"
        indexed = {r: (parent, k) for parent, e in self._by_parent.items() for k, r in e.items()}
        assert set(indexed) == set(self._lru), "the snapshot index and the LRU disagree"
        for row, key in self._lru.items():
            assert indexed[row] == (key.parent, (key.extra, key.tail)), f"row {row} misindexed"
        assert set(self._pins) <= set(self._lru), "a pinned snapshot row is not committed"
