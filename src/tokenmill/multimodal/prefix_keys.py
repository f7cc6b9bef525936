"""Prefix-cache keys of a request with media: block i's extra key holds the content
hashes of the items whose placeholder runs it covers.

Placeholder tokens are the same id for every image, so without this two requests with
different pictures in the same place would share KV. Blocks wholly before the first
image keep the plain key and share with text-only requests; blocks after an image differ
through the chain (each hash folds in its parent's).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.kv_cache.prefix import BlockKey
from tokenmill.multimodal.inputs import MultiModalInputs


@dataclass(frozen=True)
class MediaBlockKeys:
    base: bytes
    """The request's own extra key (its cache salt)."""
    spans: tuple[tuple[int, int, bytes], ...]
    """(offset, end, content hash) per item."""

    def key(self, block: int, block_size: int) -> bytes:
        lo, hi = block * block_size, (block + 1) * block_size
        hashes = [h for a, b, h in self.spans if a < hi and b > lo]
        return self.base + b"".join(hashes) if hashes else self.base


def media_block_keys(base: BlockKey, mm: MultiModalInputs) -> BlockKey:
    if not mm.items or not isinstance(base, bytes):
        return base
    spans = tuple((r.offset, r.end, it.content_hash) for r, it in zip(mm.ranges, mm.items))
    return MediaBlockKeys(base, spans)
