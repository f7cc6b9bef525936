"""What cache each layer needs: one small frozen spec per layer, declared by the model.

A model's ``cache_specs()`` gives one spec per layer, derived from its config. The
coordinator (``coordinator.py``) groups the layers by spec, sizes one manager per group
and allocates the tensors (``allocate_caches``):

- ``FullAttention`` / ``SlidingWindow``: paged K/V, a tensor ``[2, num_blocks, block_size,
  kv_heads, head_dim]`` per layer; the blocks of a request are listed in its block table.
- ``RecurrentState``: one fixed slot per live request, a tensor ``[num_slots, *shape]`` per
  layer (a state-space or linear-recurrent layer's state after the request's computed
  tokens).
- ``CrossAttention``: one fixed slot per request holding the encoder's K/V,
  ``[num_slots, 2, max_source_len, kv_heads, head_dim]`` (no model uses it yet).
- ``NoCache``: nothing (an MLP-only or pooling layer).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullAttention:
    """Causal self-attention over every earlier token: paged K/V blocks."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    paged = True
    reuses_prefix = True
    """Blocks of a shared prefix hold the same K/V for every request: prefix caching works."""

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def page_key(self) -> tuple:
        """Specs with equal keys can share one block table (one paged manager)."""
        return (self.num_kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """Self-attention over the last ``window`` tokens only. It shares the full-attention
    layers' block table when the page shapes agree (the window is a mask at attention time;
    blocks that fell out of every window are not freed early)."""

    window: int = 0


@dataclass(frozen=True)
class RecurrentState:
    """A fixed-size state per request, updated token by token (h = f(h, x)). It can not be
    rebuilt from a cached prefix of blocks (snapshots keep copies: ``kv_cache/snapshots``)
    nor rolled back by itself (a verify step keeps per-position copies for rejected
    drafts: ``worker/state_rollback``).

    A layer that keeps several state tensors (a convolution window and an SSM / delta-rule
    state) declares them with ``RecurrentState.of(conv_shape, ssm_shape, dtype=...)``: one
    flat ``[num_slots, sum of sizes]`` tensor holds them, and ``split`` gives each part as a
    ``[num_slots, *part]`` view of it (no copy)."""

    shape: tuple[int, ...]
    """One slot's shape ((sum of the parts' sizes,) when ``parts`` is set)."""
    dtype: torch.dtype
    parts: tuple[tuple[int, ...], ...] = ()
    """The shapes of the state tensors packed into one slot; () for a single tensor."""

    paged = False
    reuses_prefix = False

    @classmethod
    def of(cls, *parts: tuple[int, ...], dtype: torch.dtype) -> RecurrentState:
        """Several state tensors per slot, packed one after another."""
        return cls((sum(math.prod(p) for p in parts),), dtype, tuple(parts))

    def slot_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, *self.shape)

    def slot_bytes(self) -> int:
        """Bytes of one slot (every part)."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def split(self, cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The layer's ``[num_slots, *shape]`` tensor -> one ``[num_slots, *part]`` view per
        part (the tensor itself, as the only part, when no parts were declared)."""
        if not self.parts:
            return (cache,)
        views, start = [], 0
        for part in self.parts:
            size = math.prod(part)
            views.append(cache[:, start : start + size].view(cache.shape[0], *part))
            start += size
        return tuple(views)


@dataclass(frozen=True)
class CrossAttention:
    """Attention over an encoder's output (speech, images): a fixed slot per request with
    the encoder K/V of up to ``max_source_len`` positions, written once at admission."""

    num_kv_heads: int
    head_dim: int
    max_source_len: int
    dtype: torch.dtype

    paged = False
    reuses_prefix = False

    def slot_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, 2, self.max_source_len, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class NoCache:
    """A layer that keeps nothing between steps."""

    paged = False
    reuses_prefix = True


CacheSpec = FullAttention | SlidingWindow | RecurrentState | CrossAttention | NoCache
"""One layer's cache kind with its shape and dtype."""


def uses_slots(spec: CacheSpec) -> bool:
    """A fixed slot per request (recurrent state, cross-attention), not paged blocks."""
    return isinstance(spec, (RecurrentState, CrossAttention))


def allocate_caches(
    specs: Sequence[CacheSpec],
    num_blocks: int,
    block_size: int,
    num_slots: int,
    device: torch.device | str,
) -> list[torch.Tensor | None]:
    """One zeroed tensor per layer (None for ``NoCache``): pages for attention layers,
    slots for the others. Zeroed, not empty: padded positions are masked but still
    multiplied by 0."""
    caches: list[torch.Tensor | None] = []
    for spec in specs:
        if isinstance(spec, FullAttention):
            shape = spec.page_shape(num_blocks, block_size)
        elif isinstance(spec, (RecurrentState, CrossAttention)):
            shape = spec.slot_shape(num_slots)
        else:
            caches.append(None)
            continue
        caches.append(zeros(shape, spec.dtype, device))
    return caches


LAZY_ZEROS_BYTES = 1 << 20
"""CPU tensors at least this big come from the OS's zero pages (``zeros``)."""


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On CPU a big one is an anonymous memory map: the OS hands out
    zero-filled pages on first touch, so allocating a multi-GB KV cache costs nothing at
    start-up (``torch.zeros`` writes every byte: ~0.9 s for SmolLM2's 1 GiB default
    cache here) and pages no request reaches are never resident. The tensor keeps the
    map alive; the pages go back to the OS when it is freed."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # anonymous, private, read-write: zero-filled
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(tuple(shape))


def bytes_per_block(specs: Sequence[CacheSpec], block_size: int) -> int:
    """Bytes one block id costs over all paged layers (what sizes the block pool)."""
    total = 0
    for spec in specs:
        if isinstance(spec, FullAttention):
            elem = torch.empty((), dtype=spec.dtype).element_size()
            total += 2 * block_size * spec.num_kv_heads * spec.head_dim * elem
    return total


def state_bytes_per_slot(specs: Sequence[CacheSpec]) -> int:
    """Bytes one state slot costs over all recurrent layers (what sizes the slot pool)."""
    return sum(s.slot_bytes() for s in specs if isinstance(s, RecurrentState))
