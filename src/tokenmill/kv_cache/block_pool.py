"""A fixed pool of KV blocks with reference counts.

Free blocks sit in a FIFO queue: the block freed longest ago is handed out first.
That order is what least-recently-used eviction of cached prefix blocks needs
once blocks carry hashes (prefix caching plugs in here, not in the scheduler).
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each). The caller checks num_free first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free.

        Released in reverse so that a request's tail blocks are reused before
        its head blocks (the head is what a later prefix hit would want).
        """
        for b in reversed(blocks):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def free_block_ids(self) -> list[int]:
        return list(self._free)
