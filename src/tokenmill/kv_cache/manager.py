"""Which KV blocks each request holds; the scheduler's only view of the cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.kv_cache.block_pool import BlockPool, CachedBlock
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.kv_cache.prefix import BlockKey, extend_hashes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters (tokens are prompt tokens at admission)."""

    queries: int = 0
    """Admissions that looked the cache up."""
    hits: int = 0
    """Admissions that reused at least one block."""
    matched_tokens: int = 0
    """Tokens whose blocks were found in the cache."""
    reused_tokens: int = 0
    """Tokens not recomputed thanks to the cache (matched minus a last full block
    that must be recomputed to produce logits)."""


@dataclass
class _Seq:
    row: int
    """This request's row of ``KVCacheManager.tables`` (the same ids as ``table``)."""
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    committed: int = 0
    """Leading blocks of ``table`` already committed to the prefix cache."""


class KVCacheManager:
    """Small API for the scheduler: ``get_computed_blocks``, ``allocate_slots``,
    ``commit``, ``truncate``, ``free``.

    Invariant: a request holding b blocks can store b * block_size tokens; slot
    of token position p is ``table[p // block_size] * block_size + p % block_size``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_blocks_per_seq: int = 16,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables = BlockTableArray(width=max_blocks_per_seq)
        """Every table also as a row of one host array (the runner's step input)."""
        self.stats = PrefixCacheStats()
        self._seqs: dict[str, _Seq] = {}

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

    def get_computed_blocks(
        self, request_id: str, token_ids: list[int], extra_key: BlockKey = b"", reuse: bool = True
    ) -> int:
        """Take the longest cached prefix of ``token_ids`` for a request that holds no blocks.

        Returns the number of tokens whose KV is already there. At least one
        token is always left to compute (its logits give the next token).
        """
        seq = self._seq(request_id)
        assert not seq.table, "prefix lookup for a request that already holds blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        extend_hashes(seq.hashes, token_ids, len(token_ids), bs, extra_key)
        if not reuse:
            return 0
        self.stats.queries += 1
        parent: int | None = None
        for i, h in enumerate(seq.hashes):
            b = self.pool.lookup(h, tuple(token_ids[i * bs : (i + 1) * bs]), parent)
            if b is None:
                break
            seq.table.append(b)
            parent = b
        matched = len(seq.table) * bs
        while len(seq.table) * bs >= len(token_ids):  # keep one token to compute
            seq.table.pop()
        for b in seq.table:
            self.pool.touch(b)
        self.tables.write(seq.row, 0, seq.table)
        seq.committed = len(seq.table)
        reused = len(seq.table) * bs
        self.stats.matched_tokens += matched
        self.stats.reused_tokens += reused
        self.stats.hits += bool(reused)
        return reused

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the first ``num_tokens`` tokens of a request.

        All or nothing: returns False, changing nothing, when too few blocks are free.
        """
        seq = self._seqs.get(request_id) or self._seq(request_id)  # (per request per step)
        need = -(-num_tokens // self.block_size) - len(seq.table)  # blocks_needed, inlined
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        new = self.pool.allocate(need)
        self.tables.write(seq.row, len(seq.table), new)
        seq.table.extend(new)
        return True

    def commit(
        self, request_id: str, token_ids: list[int], num_computed: int, extra_key: BlockKey = b""
    ) -> None:
        """Make the request's full, computed blocks findable for later requests.

        ``token_ids`` are the tokens whose KV may be shared (the caller passes
        only the prompt when generated tokens must not be cached).
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        bs = self.block_size
        full = min(num_computed, len(token_ids)) // bs
        if full <= seq.committed:
            return
        extend_hashes(seq.hashes, token_ids, full * bs, bs, extra_key)
        for i in range(seq.committed, full):
            parent = seq.table[i - 1] if i else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            self.pool.commit(seq.table[i], CachedBlock(seq.hashes[i], tokens, parent))
        seq.committed = full

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll a request back to its first ``num_tokens`` tokens: blocks past them return
        to the pool (rejected draft tokens). Committed blocks are never dropped: they hold
        only accepted tokens, which a rollback keeps."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        keep = max(blocks_needed(num_tokens, self.block_size), seq.committed)
        if keep >= len(seq.table):
            return
        dropped = seq.table[keep:]
        del seq.table[keep:]
        self.tables.write(seq.row, keep, [0] * len(dropped))
        self.pool.release(dropped)

    def state_cache_metrics(self) -> dict[str, int | float]:
        """No recurrent-state snapshots here (``KVCacheCoordinator``)."""
        return {}

    def block_hashes(self, request_id: str) -> list[bytes]:
        """Chain hashes of the request's full blocks known so far (the live list)."""
        seq = self._seqs.get(request_id)
        return seq.hashes if seq else []

    def keep_prefix(self, request_id: str, num_blocks: int) -> None:
        """Give back the cached blocks a lookup took past the first ``num_blocks`` (the
        coordinator resumes a hybrid model's request where a state snapshot exists)."""
        seq = self._seqs.get(request_id)
        if seq is None or len(seq.table) <= num_blocks:
            return
        dropped = seq.table[num_blocks:]
        del seq.table[num_blocks:]
        self.tables.write(seq.row, num_blocks, [0] * len(dropped))
        self.pool.release(dropped)
        seq.committed = min(seq.committed, num_blocks)

    def state_slot(self, request_id: str) -> int:
        """Paged layers only: no request holds a state slot (see ``coordinator.py``)."""
        return -1

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids (the live list: read it, do not keep it)."""
        seq = self._seqs.get(request_id)
        return seq.table if seq else []

    def table_row(self, request_id: str) -> int:
        """The request's row of ``tables`` (-1 when it holds nothing)."""
        seq = self._seqs.get(request_id)
        return seq.row if seq else -1

    def table_and_row(self, request_id: str) -> tuple[list[int], int]:
        """The live block list and its row of ``tables`` ([], -1 when it holds nothing)."""
        seq = self._seqs.get(request_id)
        return (seq.table, seq.row) if seq else ([], -1)

    def _seq(self, request_id: str) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = _Seq(self.tables.acquire())
        return seq

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it holds none).

        Committed blocks stay findable until the pool reuses them.
        """
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.tables.release(seq.row)
        if seq.table:
            self.pool.release(seq.table)

    def reset_prefix_cache(self) -> int:
        """Forget all cached blocks; returns how many were dropped."""
        return self.pool.reset_cache()

    def check_integrity(self) -> None:
        """Every block is free xor held, its ref count equals its holders, and the
        hash index and the committed entries agree."""
        pool = self.pool
        holders = [0] * pool.num_blocks
        for seq in self._seqs.values():
            for b in seq.table:
                holders[b] += 1
            row = self.tables.array[seq.row]
            assert (
                row[: len(seq.table)].tolist() == seq.table and not row[len(seq.table) :].any()
            ), f"table row {seq.row} disagrees with its list"
        free = set(pool.free_block_ids())
        assert len(free) == pool.num_free, "a block is in the free queue twice"
        for b, (count, ref) in enumerate(zip(holders, pool.ref_counts)):
            assert count == ref, f"block {b}: ref count {ref}, held by {count} requests"
            assert (ref == 0) == (b in free), f"block {b}: ref count {ref}, free={b in free}"
        for h, b in pool.by_hash.items():
            entry = pool.committed[b]
            assert entry is not None and entry.block_hash == h, (
                f"hash index points at block {b} wrongly"
            )
        assert sum(e is not None for e in pool.committed) == len(pool.by_hash), (
            "unindexed committed block"
        )
