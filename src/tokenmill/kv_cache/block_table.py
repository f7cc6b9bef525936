"""Every live request's block table as one row of a host array, for the model runner.

The KV manager keeps each table as a Python list (the scheduler's view) and mirrors it
here: a request holds one row of an int64 array [rows, width], its block ids first and
zeros after. A step's [B, width] block-table input is then one numpy gather of B rows
(``gather``), not B Python lists rebuilt and flattened every step — at 256 sequences of
~50 blocks that rebuild cost the host about a millisecond per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableArray:
    """Rows handed out to requests (``acquire`` / ``release``), written as their tables
    grow (``write``). Grows by doubling in rows and in width, so read ``array`` afresh
    each step rather than keeping it."""

    def __init__(self, width: int = 16, rows: int = 16) -> None:
        self.array = np.zeros((max(rows, 1), max(width, 1)), dtype=np.int64)
        self._free_rows = list(range(self.array.shape[0] - 1, -1, -1))  # pop() -> row 0 first

    @property
    def width(self) -> int:
        return self.array.shape[1]

    def acquire(self) -> int:
        if not self._free_rows:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def release(self, row: int) -> None:
        self.array[row] = 0
        self._free_rows.append(row)

    def write(self, row: int, start: int, blocks: Sequence[int]) -> None:
        """Table entries start.. of ``row`` := blocks."""
        end = start + len(blocks)
        if end > self.width:
            width = max(end, 2 * self.width)
            grown = np.zeros((self.array.shape[0], width), dtype=np.int64)
            grown[:, : self.width] = self.array
            self.array = grown
        self.array[row, start:end] = blocks

    def gather(self, rows: Sequence[int], out: np.ndarray) -> None:
        """out [len(rows), W] := the first W entries of each row (zeros past the array)."""
        width = min(out.shape[1], self.width)
        out[:, :width] = self.array[rows, :width]
        out[:, width:] = 0
