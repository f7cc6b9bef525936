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
- **prefix reuse is the minimum over groups**: a recurrent state can not be rebuilt from
  cached blocks, so its group reuses 0 tokens and the coordinator's reusable prefix is 0
  (lookups are made with ``reuse=False``: hashes are kept, no block is taken);
- **preemption recomputes**: the state slot is freed with the blocks, and the request
  comes back at token 0; the layer resets a state whose sequence starts at token 0
  (``StateMetadata.fresh``), so a reused slot's old values never leak. (Copying states
  to the host on preemption would save the recompute; nothing needs it yet.)
- **no rollback of a state**: ``truncate`` below the tokens a state already holds raises
  (rejected draft tokens would need a state snapshot per draft position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache.block_pool import BlockPool
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.kv_cache.manager import KVCacheManager, PrefixCacheStats
from tokenmill.kv_cache.prefix import BlockKey
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
) -> KVCacheManager | KVCacheCoordinator:
    """The scheduler's cache manager for a model whose layers need ``specs``: the paged
    manager itself when no layer needs state slots, else a coordinator over both."""
    groups = group_layers(specs)
    paged = KVCacheManager(num_blocks, block_size, enable_prefix_caching, max_blocks_per_seq)
    if not any(g.kind == "slots" for g in groups):
        return paged
    return KVCacheCoordinator(groups, paged, StateSlots(num_slots))


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
        self, groups: tuple[CacheGroup, ...], paged: KVCacheManager, slots: StateSlots
    ) -> None:
        self.groups = groups
        self.paged = paged
        self.slots = slots
        self.reuse_prefix = all(s.reuses_prefix for g in groups for s in g.specs)
        """False when a group can not start from a cached prefix: reuse is then 0 tokens."""

    # -- what the scheduler and the engine read ------------------------------------------
    @property
    def block_size(self) -> int:
        return self.paged.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        return self.paged.enable_prefix_caching and self.reuse_prefix

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

    def block_table(self, request_id: str) -> list[int]:
        return self.paged.block_table(request_id)

    # -- what the scheduler does -----------------------------------------------------------
    def get_computed_blocks(
        self, request_id: str, token_ids: list[int], extra_key: BlockKey = b"", reuse: bool = True
    ) -> int:
        """The reusable prefix, the minimum over groups: 0 while a group can not reuse one."""
        reuse = reuse and self.reuse_prefix
        return self.paged.get_computed_blocks(request_id, token_ids, extra_key, reuse)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` tokens and a state slot: both or neither."""
        if not self.slots.holds(request_id) and self.slots.num_free == 0:
            return False
        if not self.paged.allocate_slots(request_id, num_tokens):
            return False
        taken = self.slots.allocate(request_id, num_tokens)
        assert taken, "a free slot was checked for"
        return True

    def commit(
        self, request_id: str, token_ids: list[int], num_computed: int, extra_key: BlockKey = b""
    ) -> None:
        if self.reuse_prefix:  # otherwise nobody could ever reuse what is committed
            self.paged.commit(request_id, token_ids, num_computed, extra_key)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll the blocks back to ``num_tokens`` tokens; a state can not roll back."""
        if num_tokens < self.slots.num_tokens(request_id):
            raise NotImplementedError(
                f"request {request_id!r}: a recurrent state can not roll back from "
                f"{self.slots.num_tokens(request_id)} to {num_tokens} tokens (speculative "
                "decoding of hybrid models needs per-position state snapshots)"
            )
        self.paged.truncate(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        self.paged.free(request_id)
        self.slots.free(request_id)

    def reset_prefix_cache(self) -> int:
        return self.paged.reset_prefix_cache()

    def check_integrity(self) -> None:
        """The paged manager's checks, the slots' checks, and the two agree on holders."""
        self.paged.check_integrity()
        self.slots.check_integrity()
        for request_id in self.slots.holders():
            assert self.paged.table_and_row(request_id)[1] >= 0, f"{request_id}: a slot, no table"
