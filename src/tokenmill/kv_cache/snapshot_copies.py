"""The snapshot pool's tensors and a step's copies (the host side is ``snapshots.py``).

Per layer, like the caches (``spec.allocate_caches``): a recurrent layer's snapshots are
``[rows, *slot shape]`` (the same packing as its slots), a paged layer's are the tails
``[rows, 2, block_size, kv_heads, head_dim]`` (one block of K/V: a snapshot inside a
block needs that block's first tokens, which the prefix cache does not hold). A step's
copies are one ``index_copy_`` per layer and direction, none when it has nothing to copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.kv_cache.snapshots import StateStep
from tokenmill.kv_cache.spec import FullAttention, RecurrentState, zeros


class SnapshotTensors:
    """``tensors[i]``: layer i's snapshots (None for layers with nothing to keep)."""

    def __init__(
        self, specs: Sequence[object], caches: Sequence[torch.Tensor | None], rows: int
    ) -> None:
        self.tensors: list[torch.Tensor | None] = []
        self._paged: list[bool] = []
        for spec, cache in zip(specs, caches):
            paged = isinstance(spec, FullAttention)
            if cache is None or not (paged or isinstance(spec, RecurrentState)):
                self.tensors.append(None)
            elif paged:  # cache [2, num_blocks, block_size, kv_heads, head_dim]
                self.tensors.append(zeros((rows, 2, *cache.shape[2:]), cache.dtype, cache.device))
            else:  # cache [num_slots, *shape]
                self.tensors.append(zeros((rows, *cache.shape[1:]), cache.dtype, cache.device))
            self._paged.append(paged)

    def restore(self, step: StateStep, caches: Sequence[torch.Tensor | None]) -> None:
        """Rows -> the admitted requests' slots, and their tails -> their new blocks."""
        self._copy(step.restore_rows, step.restore_slots, step.restore_blocks, caches, True)

    def save(self, step: StateStep, caches: Sequence[torch.Tensor | None]) -> None:
        """Slots at a chunk's end -> rows, and the partial blocks -> the rows' tails (also
        for the states the scans kept inside a chunk: their tails only)."""
        self._copy(step.save_rows, step.save_slots, step.save_blocks, caches, False)
        self._copy(step.tail_rows, (), step.tail_blocks, caches, False)

    def _copy(self, rows, slots, blocks, caches, into_cache: bool) -> None:
        """``slots`` () copies the paged layers' tails only."""
        if not rows:
            return
        device = next(t.device for t in self.tensors if t is not None)
        row_t = torch.tensor(rows, dtype=torch.int64, device=device)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
        tails = [i for i, b in enumerate(blocks) if b >= 0]
        tail_rows = row_t[tails] if tails else None
        block_t = torch.tensor([blocks[i] for i in tails], dtype=torch.int64, device=device)
        for snap, cache, paged in zip(self.tensors, caches, self._paged):
            if snap is None or cache is None:
                continue
            if not paged:
                if not slots:
                    continue
                if into_cache:
                    cache.index_copy_(0, slot_t, snap.index_select(0, row_t))
                else:
                    snap.index_copy_(0, row_t, cache.index_select(0, slot_t))
            elif tail_rows is not None:
                if into_cache:  # [n, 2, bs, h, d] -> blocks of [2, nb, bs, h, d]
                    cache.index_copy_(1, block_t, snap.index_select(0, tail_rows).transpose(0, 1))
                else:
                    snap.index_copy_(0, tail_rows, cache.index_select(1, block_t).transpose(0, 1))
