"""A fixed pool of KV blocks with reference counts and a prefix cache.

A full block can be *committed*: it gets a chain hash (see ``prefix.py``) and
stays findable by it after it is freed, until the pool hands it out again for
new content (an eviction). Free blocks wait in two queues: the empty ones
(never committed) on a stack, most recently freed on top, and the committed ones
in least-recently-freed order. Allocation takes empty blocks first, so no cached
prefix is evicted while an empty block is left, and the block it takes is the
warmest one: its pages are resident and likely still in the CPU caches, where a
block that was never written costs a page fault and the kernel's zeroing on its
first write (about 20% of a decode step's time at 32 sequences on CPU, until the
whole pool has been touched once). A lookup re-checks the block's tokens and its parent block, so a
hash collision can never serve wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedBlock:
    """What a committed block holds: its hash, tokens and the block before it."""

    block_hash: bytes
    tokens: tuple[int, ...]
    parent: int | None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.committed: list[CachedBlock | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._empty = list(range(num_blocks - 1, -1, -1))  # pop() -> block 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # committed, LRU first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Committed blocks still findable (in use or free)."""
        return len(self.by_hash)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each): empty ones, most recently freed
        first, then committed ones, least recently freed first (evicted from the
        prefix cache). The caller checks ``num_free`` first.
        """
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._empty:
                b = self._empty.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                self._uncommit(b)
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, block: int) -> None:
        """Take one more reference to a committed block found by a lookup."""
        if self.ref_counts[block] == 0:
            del self._cached[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free.

        Released tail first, so that a request's last blocks (least likely to
        be shared) are evicted before its first ones, and its first empty block
        is the next one taken.
        """
        for b in reversed(blocks):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free_one(b)

    def _free_one(self, block: int) -> None:
        if self.committed[block] is None:
            self._empty.append(block)
        else:
            self._cached[block] = None

    def commit(self, block: int, entry: CachedBlock) -> None:
        """Make a full, held block findable by its hash (first writer wins on duplicates)."""
        assert self.ref_counts[block] > 0, f"block {block} committed while free"
        if entry.block_hash in self.by_hash or self.committed[block] is not None:
            return
        self.committed[block] = entry
        self.by_hash[entry.block_hash] = block

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...], parent: int | None) -> int | None:
        """The committed block with this hash, if its tokens and parent really match."""
        b = self.by_hash.get(block_hash)
        if b is None:
            return None
        entry = self.committed[b]
        if entry is None or entry.tokens != tokens or entry.parent != parent:
            return None
        return b

    def reset_cache(self) -> int:
        """Forget every committed block (in-use blocks keep their contents). Returns how many."""
        count = len(self.by_hash)
        for b in list(self.by_hash.values()):
            self._uncommit(b)
        self._empty.extend(self._cached)  # the free committed blocks are empty now
        self._cached.clear()
        return count

    def _uncommit(self, block: int) -> None:
        entry = self.committed[block]
        if entry is not None:
            self.by_hash.pop(entry.block_hash, None)
            self.committed[block] = None

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order ``allocate`` takes them."""
        return self._empty[::-1] + list(self._cached)
