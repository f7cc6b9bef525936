"""A fixed pool of KV blocks with reference counts and a prefix cache.

Free blocks wait in least-recently-freed order. A full block can be
*committed*: it gets a chain hash (see ``prefix.py``) and stays findable by it
after it is freed, until the pool hands it out again for new content (an
eviction). A lookup re-checks the block's tokens and its parent block, so a
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
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Committed blocks still findable (in use or free)."""
        return len(self.by_hash)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks (ref count 1 each), least recently freed first.

        A taken block that was committed is evicted from the prefix cache.
        The caller checks ``num_free`` first.
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if self.committed[b] is not None:
                self._uncommit(b)
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, block: int) -> None:
        """Take one more reference to a committed block found by a lookup."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach zero become free.

        Released tail first, so that a request's last blocks (least likely to
        be shared) are evicted before its first ones.
        """
        for b in reversed(blocks):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    def commit(self, block: int, entry: CachedBlock) -> None:
        """Make a full block findable by its hash (first writer wins on duplicates)."""
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
        return count

    def _uncommit(self, block: int) -> None:
        entry = self.committed[block]
        if entry is not None:
            self.by_hash.pop(entry.block_hash, None)
            self.committed[block] = None

    def free_block_ids(self) -> list[int]:
        return list(self._free)
