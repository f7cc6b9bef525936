"""One cache manager per group of layers, behind the API the scheduler already uses.

``make_kv_cache(specs, ...)`` groups a model's layers by cache spec (``spec.py``):

- paged attention layers (full and sliding-window) whose pages have one shape share one
  ``KVCacheManager`` (one block table per request, one prefix cache);
- layers with a fixed state per request (recurrent state, cross-attention) share one
  ``StateSlots`` (one slot id per request, used by each of those layers' tensors);
- ``NoCache`` layers need nothing.

When every layer is paged attention the manager itself is returned: no wrapper, nothing
extra per step. Otherwise a ``KVCacheCoordinator`` presents the manager's API and keeps
the slots in step with the blocks:

- ``allocate_slots`` is all or nothing over both groups (a request without a slot takes
  one; too few blocks or no free slot changes nothing and returns False, so the scheduler
  preempts as it does for blocks);
- ``free`` (finish, abort, preemption) gives both back;
- **prefix reuse needs a state snapshot** (``snapshots.py``): a recurrent state can not be
  rebuilt from cached blocks, so a hit is the longest cached prefix whose end has a
  snapshot (the blocks before it from the prefix cache, the state and the partial
  block's K/V from the snapshot). Without a snapshot pool (a budget of 0) the reusable
  prefix is 0 (lookups are made with ``reuse=False``: hashes are kept, no block is taken);
- **preemption recomputes**: the state slot is freed with the blocks, and the request
  comes back at token 0 (or at a snapshot); the layer resets a state whose sequence
  starts at token 0 (``StateMetadata.fresh``), so a reused slot's old values never leak;
- **rollback of rejected drafts**: the runner copies the state a verify step kept after
  the accepted drafts into the slot (``worker/state_rollback.py``); ``truncate`` rolls the
  blocks back and drops the snapshots reserved past the new end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.kv_cache.manager import KVCacheManager, PrefixCacheStats
from tokenmill.kv_cache.prefix import BlockKey
from tokenmill.kv_cache.snapshots import (
    SnapshotKey,
    SnapshotPool,
    StateStep,
    checkpoint_interval,
    row_bytes,
)
from tokenmill.kv_cache.spec import (
    CacheSpec,
    FullAttention,
    RecurrentState,
    bytes_per_block,
    state_bytes_per_slot,
    uses_slots,
)
from tokenmill.kv_cache.state_slots import StateSlots


@dataclass(frozen=True)
class CacheGroup:
    """Layers that share one manager."""

    kind: str
    """"paged", "slots" or "none"."""
    layers: tuple[int, ...]
    specs: tuple[CacheSpec, ...]


def group_layers(specs: Sequence[CacheSpec]) -> tuple[CacheGroup, ...]:
    """The layers of each kind, in layer order. Raises when paged layers disagree on
    their page shape (one block table per request serves one page shape)."""
    kinds: dict[str, list[int]] = {"paged": [], "slots": [], "none": []}
    for i, spec in enumerate(specs):
        kind = (
            "paged" if isinstance(spec, FullAttention) else "slots" if uses_slots(spec) else "none"
        )
        kinds[kind].append(i)
    keys = {specs[i].page_key() for i in kinds["paged"]}  # type: ignore[union-attr]
    if len(keys) > 1:
        raise NotImplementedError(
            f"paged layers with different page shapes {sorted(map(str, keys))} need a block "
            "table per group; this engine keeps one per request"
        )
    return tuple(
        CacheGroup(kind, tuple(layers), tuple(specs[i] for i in layers))
        for kind, layers in kinds.items()
        if layers
    )


def make_kv_cache(
    specs: Sequence[CacheSpec],
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool = True,
    max_blocks_per_seq: int = 16,
    num_slots: int = 1,
    snapshot_rows: int = 0,
) -> KVCacheManager | KVCacheCoordinator:
    """The scheduler's cache manager for a model whose layers need ``specs``: the paged
    manager itself when no layer needs state slots, else a coordinator over both (with a
    pool of ``snapshot_rows`` recurrent-state snapshots when prefix caching is on)."""
    groups = group_layers(specs)
    paged = KVCacheManager(num_blocks, block_size, enable_prefix_caching, max_blocks_per_seq)
    if not any(g.kind == "slots" for g in groups):
        return paged
    pool = None
    if snapshot_rows > 0 and enable_prefix_caching:
        pool = SnapshotPool(snapshot_rows, row_bytes(specs, block_size))
    return KVCacheCoordinator(groups, paged, StateSlots(num_slots), pool)


def state_pool_slots(
    specs: Sequence[CacheSpec],
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    cache_size: int | None = None,
    memory_ratio: float | None = None,
) -> int:
    """How many state slots to keep: ``cache_size`` when given; else, for models with
    recurrent layers, as many as ``memory_ratio`` (default 1.0) times the paged layers' KV
    bytes hold, at most ``max_num_seqs`` (a slot per running request; more would stay
    idle). Raises when that is not one slot: no request could run."""
    if cache_size is not None:
        return cache_size
    slot_bytes = state_bytes_per_slot(specs)
    kv_bytes = num_blocks * bytes_per_block(specs, block_size)
    if not any(isinstance(s, RecurrentState) for s in specs) or kv_bytes == 0:
        return max_num_seqs
    ratio = 1.0 if memory_ratio is None else memory_ratio
    slots = int(ratio * kv_bytes // slot_bytes)
    if slots < 1:
        raise InvalidRequestError(
            f"the recurrent-state pool holds no request: ssm_full_memory_ratio={ratio} of "
            f"{kv_bytes} KV bytes is {int(ratio * kv_bytes)} bytes, one request's state takes "
            f"{slot_bytes}; raise ssm_full_memory_ratio or the KV cache, or set "
            "ssm_state_cache_size"
        )
    return min(slots, max_num_seqs)


class KVCacheCoordinator:
    """The paged manager's API (what ``Scheduler`` calls) over a paged group and a state
    slot group; see the module docstring for the policies."""

    def __init__(
        self,
        groups: tuple[CacheGroup, ...],
        paged: KVCacheManager,
        slots: StateSlots,
        snapshots: SnapshotPool | None = None,
    ) -> None:
        self.groups = groups
        self.paged = paged
        self.slots = slots
        self.snapshots = snapshots
        """Recurrent-state snapshots (``snapshots.py``); None: a prefix is never reused."""
        self.reuse_prefix = all(s.reuses_prefix for g in groups for s in g.specs)
        """True when every group can start from cached blocks alone (no recurrent state)."""
        self.interval = checkpoint_interval(paged.block_size)
        """Tokens between interval snapshots."""
        self._ends: dict[str, int] = {}
        """Tokens each request's state will hold once its scheduled steps ran."""
        self._known: dict[str, int] = {}
        """Tokens known at admission (where a prompt, or a recomputed sequence, ends)."""
        self._limit: dict[str, int] = {}
        """Requests whose generated tokens may not be cached: how many tokens may."""
        self._restores: dict[str, tuple[int, int]] = {}
        """Admitted from a snapshot, not yet copied: request -> (row, position)."""
        self._saves: dict[str, tuple[int, int, list[tuple[int, int]]]] = {}
        """Snapshots the step being scheduled writes: request -> (its chunk's start, end,
        [(position, row)])."""

    # -- what the scheduler and the engine read ------------------------------------------
    @property
    def block_size(self) -> int:
        return self.paged.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        caching = self.paged.enable_prefix_caching
        return caching and (self.reuse_prefix or self.snapshots is not None)

    @property
    def pool(self) -> BlockPool:
        return self.paged.pool

    @property
    def tables(self) -> BlockTableArray:
        return self.paged.tables

    @property
    def stats(self) -> PrefixCacheStats:
        return self.paged.stats

    @property
    def num_free_blocks(self) -> int:
        return self.paged.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.paged.num_blocks

    @property
    def usage(self) -> float:
        """The larger of the block and slot usage (what limits admission)."""
        slot_usage = 1.0 - self.slots.num_free / self.slots.num_slots
        return max(self.paged.usage, slot_usage)

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1 when it holds none)."""
        return self.slots.slot(request_id)

    def table_and_row(self, request_id: str) -> tuple[list[int], int]:
        return self.paged.table_and_row(request_id)

    def table_row(self, request_id: str) -> int:
        return self.paged.table_row(request_id)

    def block_table(self, request_id: str) -> list[int]:
        return self.paged.block_table(request_id)

    def state_cache_metrics(self) -> dict[str, int | float]:
        """Snapshot counters and the bytes held (``LLMEngine.prefix_cache_metrics``)."""
        pool = self.snapshots
        if pool is None:
            return {}
        return {
            "recurrent_snapshot_restores": pool.stats.restores,
            "recurrent_snapshot_hit_tokens": pool.stats.hit_tokens,
            "recurrent_snapshot_saves": pool.stats.saves,
            "recurrent_snapshot_evictions": pool.stats.evictions,
            "recurrent_snapshot_bytes": pool.held_bytes,
            "recurrent_snapshot_pool_bytes": pool.num_rows * pool.row_bytes,
        }

    # -- what the scheduler does -----------------------------------------------------------
    def get_computed_blocks(
        self, request_id: str, token_ids: list[int], extra_key: BlockKey = b"", reuse: bool = True
    ) -> int:
        """The reusable prefix: with recurrent layers, the longest cached prefix whose end
        has a state snapshot (0 without a snapshot pool)."""
        if self.reuse_prefix or self.snapshots is None:
            reuse = reuse and self.reuse_prefix
            return self.paged.get_computed_blocks(request_id, token_ids, extra_key, reuse)
        self._known[request_id] = len(token_ids)
        reused = self.paged.get_computed_blocks(request_id, token_ids, extra_key, reuse)
        if not reuse:
            return 0
        bs = self.block_size
        hashes = self.paged.block_hashes(request_id)[: reused // bs]
        found = self.snapshots.find(hashes, token_ids, bs, _extra_of(extra_key, bs))
        position, row = found or (0, -1)
        self.paged.keep_prefix(request_id, position // bs)
        stats = self.paged.stats  # the manager counted its blocks; the hit is the snapshot's
        stats.reused_tokens += position - reused
        stats.hits += bool(position) - bool(reused)
        if found:
            self.snapshots.pin(row)
            self._restores[request_id] = (row, position)
            self.snapshots.stats.restores += 1
            self.snapshots.stats.hit_tokens += position
        self._ends[request_id] = position
        return position

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` tokens and a state slot: both or neither. With a
        snapshot pool, rows for the snapshots this step's new tokens reach."""
        if not self.slots.holds(request_id) and self.slots.num_free == 0:
            return False
        if not self.paged.allocate_slots(request_id, num_tokens):
            return False
        taken = self.slots.allocate(request_id, num_tokens)
        assert taken, "a free slot was checked for"
        # Rows only for admitted requests: the scratch sequences of the verify-cost
        # measurement (``spec_decode/calibrate.py``) never went through get_computed_blocks.
        if self.snapshots is not None and request_id in self._known:
            start = self._ends.get(request_id, 0)
            if num_tokens > start:
                self._ends[request_id] = num_tokens
                self._reserve(request_id, start, num_tokens)
        return True

    def _reserve(self, request_id: str, start: int, end: int) -> None:
        """Rows for the snapshots in (start, end]: interval positions, and the last token
        but one of those known at admission (a prompt's end less one: the same prompt again
        resumes there, a hit leaving its last token to compute for the logits, and a longer
        one, a next chat turn, recomputes one token more than from the end); not past
        tokens that may not be cached, at most as many as the pool holds (the latest)."""
        assert self.snapshots is not None
        iv = self.interval
        first = (start // iv + 1) * iv
        last = self._known.get(request_id, 0) - 1
        at_last = start < last <= end and last % iv
        if first > end and not at_last:  # the common decode step: nothing to save
            return
        positions = sorted([*range(first, end + 1, iv), *([last] if at_last else [])])
        limit = self._limit.get(request_id)
        if limit is not None:
            positions = [p for p in positions if p <= limit]
        saves = []
        for p in positions[-self.snapshots.num_rows :]:
            row = self.snapshots.reserve(request_id, p)
            if row is not None:
                saves.append((p, row))
        if saves:
            self._saves[request_id] = (start, end, saves)

    def state_step(self, request_ids: Sequence[str]) -> StateStep:
        """The step's state slots and snapshot copies, for the runner (once per step, just
        before it runs): restores of this step's admissions, the states its chunks keep
        inside the scans, and the chunk ends to copy after the forward."""
        slots = tuple(self.slots.slot(r) for r in request_ids)
        if not self._saves and not self._restores:
            return StateStep(slots)
        bs = self.block_size
        rr: list[int] = []
        rs: list[int] = []
        rb: list[int] = []
        for request_id, (row, position) in self._restores.items():
            table = self.paged.block_table(request_id)
            rr.append(row)
            rs.append(self.slots.slot(request_id))
            rb.append(table[position // bs] if position % bs else -1)
            self.snapshots.unpin(row)  # type: ignore[union-attr]  # copied before any reuse
        run_saves: list[tuple[tuple[int, int], ...]] = []
        sr: list[int] = []
        ss: list[int] = []
        sb: list[int] = []
        tr: list[int] = []
        tb: list[int] = []
        for request_id in request_ids:
            start, end, saves = self._saves.get(request_id, (0, 0, []))
            run_saves.append(tuple((p - start, row) for p, row in saves if p < end))
            for p, row in saves:
                table = self.paged.block_table(request_id)
                if p == end:
                    sr.append(row)
                    ss.append(self.slots.slot(request_id))
                    sb.append(table[p // bs] if p % bs else -1)
                elif p % bs:  # its state kept by the scans; its block's K/V after the forward
                    tr.append(row)
                    tb.append(table[p // bs])
        self._saves.clear()
        self._restores.clear()
        keeps = tuple(run_saves) if any(run_saves) else ()
        return StateStep(slots, keeps, tuple(rr), tuple(rs), tuple(rb),
                         tuple(sr), tuple(ss), tuple(sb), tuple(tr), tuple(tb))  # fmt: skip

    def commit(
        self, request_id: str, token_ids: list[int], num_computed: int, extra_key: BlockKey = b""
    ) -> None:
        """Commit full blocks to the prefix cache and the written snapshots under their
        prefix; snapshots past ``token_ids`` (generated tokens that may not be cached) go
        back."""
        if not self.enable_prefix_caching:  # nobody could ever reuse what is committed
            return
        self.paged.commit(request_id, token_ids, num_computed, extra_key)
        if self.snapshots is None:
            return
        upto = num_computed
        if len(token_ids) < num_computed:
            if len(token_ids) <= self._known.get(request_id, 0):  # cache_generated_tokens=False
                self._limit[request_id] = len(token_ids)
            else:  # accepted drafts, computed but not appended yet: key their rows next time
                upto = len(token_ids)
        bs, hashes = self.block_size, self.paged.block_hashes(request_id)
        extra = _extra_of(extra_key, bs)

        def key_of(p: int) -> SnapshotKey:
            k = p // bs
            return SnapshotKey(hashes[k - 1] if k else b"", extra(k), tuple(token_ids[k * bs : p]))

        self.snapshots.commit(request_id, upto, len(token_ids), key_of)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll back to ``num_tokens`` tokens (rejected drafts): the blocks, the slot's
        count (the runner already copied the state kept there into the slot), and the
        snapshots reserved past it (they hold states of rejected tokens)."""
        self.paged.truncate(request_id, num_tokens)
        self.slots.truncate(request_id, num_tokens)
        if self.snapshots is not None:
            self.snapshots.discard_after(request_id, num_tokens)
            if self._ends.get(request_id, 0) > num_tokens:
                self._ends[request_id] = num_tokens

    def free(self, request_id: str) -> None:
        self.paged.free(request_id)
        self.slots.free(request_id)
        if self.snapshots is None:
            return
        self.snapshots.discard(request_id)
        restore = self._restores.pop(request_id, None)
        if restore is not None:
            self.snapshots.unpin(restore[0])
        self._saves.pop(request_id, None)
        self._ends.pop(request_id, None)
        self._known.pop(request_id, None)
        self._limit.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        dropped = self.paged.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset()
        return dropped

    def check_integrity(self) -> None:
        """The paged manager's checks, the slots' and the snapshots' checks, and they
        agree on holders."""
        self.paged.check_integrity()
        self.slots.check_integrity()
        for request_id in self.slots.holders():
            assert self.paged.table_and_row(request_id)[1] >= 0, f"{request_id}: a slot, no table"
        if self.snapshots is not None:
            self.snapshots.check_integrity()
            pinned = sorted(row for row, _ in self._restores.values())
            assert pinned == sorted(self.snapshots.pinned_rows()), "a snapshot pin is stale"


def _extra_of(extra_key: BlockKey, block_size: int):
    """Block i -> its extra key bytes."""
    if isinstance(extra_key, bytes):
        return lambda i: extra_key
    return lambda i: extra_key.key(i, block_size)
