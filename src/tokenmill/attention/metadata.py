"""What one forward pass needs to know about the batch and the paged KV cache.

The batch is *flattened*: the new tokens of every scheduled sequence are
concatenated into one [T] vector. Sequence i owns rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step, has
``seq_lens[i]`` tokens of context in the cache (its cached prefix plus its new
tokens). KV caches are one tensor per layer of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values).
``StateMetadata`` is the same step seen by layers with a fixed state slot per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64: flat cache slot (block_id * block_size + offset) of each new token."""
    query_start_loc: tuple[int, ...]
    """B+1 row offsets of each sequence's new tokens in the flattened batch."""
    seq_lens: tuple[int, ...]
    """B context lengths after this step (cached prefix + new tokens)."""
    block_tables: torch.Tensor
    """[B, max_blocks] int64 block ids; rows padded with 0 past a sequence's blocks."""
    block_size: int
    seq_lens_tensor: torch.Tensor
    """[B] int64, the same as seq_lens, on the device (for the batched decode path)."""
    first_block_if_contiguous: tuple[int | None, ...] = ()
    """Per sequence: its first block id when its blocks are consecutive ids (the context
    is then a view of the cache, no gather), else None."""
    query_start_loc_tensor: torch.Tensor | None = None
    """[B+1] int64, query_start_loc on the device (for kernels that take the whole batch)."""
    extra_slots: torch.Tensor | None = None
    """[B, E] int64 (-1 padded, valid first): cache slots sequence b also attends past its
    context, a draft-tree node's ancestors and itself (``worker/draft_tree.py``); None:
    contexts only."""
    bidirectional_spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Per sequence, position ranges [a, b) whose tokens also see each other (every key of
    the range, later ones too: Gemma 3's image tokens), on top of the causal / window rule;
    a range's tokens from this step's first on must all be in this step. None: causal
    only (every text-only step)."""
    _masks: dict = field(default_factory=dict, compare=False, repr=False)
    """Decode masks built once per step and shared by all layers (keyed by window)."""

    def decode_mask(self, window: int | None, length: int) -> torch.Tensor:
        """Bool [B, 1, 1, length]: key slot j of sequence b is visible to its new token."""
        key = (window, length)
        if key not in self._masks:
            k_pos = torch.arange(length, device=self.seq_lens_tensor.device)[None, :]
            lens = self.seq_lens_tensor[:, None]
            allowed = k_pos < lens
            if window is not None:
                allowed &= k_pos > lens - 1 - window
            self._masks[key] = allowed[:, None, None, :]
        return self._masks[key]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(
            (b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])), default=0
        )

    @property
    def is_all_decode(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return self.query_start_loc[-1] == self.num_seqs

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from plain lists (what the model runner and tests have)."""
        qsl = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            qsl.append(qsl[-1] + q_len)
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=tuple(qsl),
            seq_lens=tuple(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
            block_size=block_size,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            first_block_if_contiguous=tuple(
                _first_if_contiguous(t, -(-s // block_size)) for t, s in zip(block_tables, seq_lens)
            ),
            query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int64, device=device),
        )


def _first_if_contiguous(table: Sequence[int], used: int) -> int | None:
    """The first block id when blocks 0..used-1 are consecutive ids (the context is then a
    view of the cache), else None."""
    if used == 0 or table[used - 1] - table[0] != used - 1:
        return None
    return table[0] if all(b == table[0] + j for j, b in enumerate(table[:used])) else None


@dataclass(frozen=True)
class StateMetadata:
    """The step as layers with a state slot per sequence see it (``kv_cache/state_slots.py``).

    Sequence i's new tokens are rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    batch (the attention metadata's offsets); its state lives in row ``slots[i]`` of each
    such layer's ``[num_slots, *shape]`` tensor and holds the state after its cached tokens.
    """

    slots: torch.Tensor
    """[B] int64 state slot of each sequence."""
    fresh: torch.Tensor
    """[B] bool: the sequence starts at token 0 this step (its slot's old values are stale:
    a new request, or one preempted and recomputed)."""
    slot_list: tuple[int, ...]
    """The same slots on the host (for per-sequence loops)."""
    fresh_list: tuple[bool, ...]
    run_saves: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per sequence, (tokens into its chunk, snapshot row) of the states to keep inside the
    chunk (``kv_cache/snapshots.py``); (): none this step."""
    snapshots: Sequence[torch.Tensor | None] | None = None
    """Each layer's snapshot rows (``kv_cache/snapshot_copies.py``); None: no pool."""
    run_keeps: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per sequence, (tokens into its chunk, rollback row) of the per-position states a
    verify step keeps for rolling back rejected drafts (``worker/state_rollback.py``);
    (): no sequence verifies drafts this step."""
    rollback: Sequence[torch.Tensor | None] | None = None
    """Each layer's rollback rows for this step; None: none."""

    @classmethod
    def build(
        cls,
        slots: Sequence[int],
        meta: AttentionMetadata,
        run_saves: tuple[tuple[tuple[int, int], ...], ...] = (),
        snapshots: Sequence[torch.Tensor | None] | None = None,
        run_keeps: tuple[tuple[tuple[int, int], ...], ...] = (),
        rollback: Sequence[torch.Tensor | None] | None = None,
    ) -> StateMetadata:
        """From each sequence's slot and the step's attention metadata."""
        qsl, device = meta.query_start_loc, meta.slot_mapping.device
        fresh = tuple(
            n == b - a for n, a, b in zip(meta.seq_lens, qsl, qsl[1:])
        )  # all of its context is new
        return cls(
            torch.tensor(list(slots), dtype=torch.int64, device=device),
            torch.tensor(fresh, dtype=torch.bool, device=device),
            tuple(slots),
            fresh,
            run_saves,
            snapshots,
            run_keeps,
            rollback,
        )
