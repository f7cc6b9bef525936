"""Which KV blocks each request holds; the scheduler's only view of the cache."""

from __future__ import annotations

from tokenmill.kv_cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KVCacheManager:
    """Small API for the scheduler: ``get_computed_blocks``, ``allocate_slots``, ``free``.

    Invariant: a request holding b blocks can store b * block_size tokens; slot
    of token position p is ``table[p // block_size] * block_size + p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def get_computed_blocks(self, request_id: str, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` already in the cache (prefix reuse hooks in here).

        Without prefix caching nothing is reused: always 0.
        """
        return 0

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the first ``num_tokens`` tokens of a request.

        All or nothing: returns False, changing nothing, when too few blocks are free.
        """
        table = self._tables.setdefault(request_id, [])
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return False
        table.extend(self.pool.allocate(need))
        return True

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(table)

    def check_integrity(self) -> None:
        """Every block is free xor held, and its ref count equals its holders."""
        holders = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for b in table:
                holders[b] += 1
        free = set(self.pool.free_block_ids())
        assert len(free) == self.pool.num_free, "a block is in the free queue twice"
        for b, (count, ref) in enumerate(zip(holders, self.pool.ref_counts)):
            assert count == ref, f"block {b}: ref count {ref}, held by {count} requests"
            assert (ref == 0) == (b in free), f"block {b}: ref count {ref}, free={b in free}"
