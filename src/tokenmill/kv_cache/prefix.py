"""Chain hashes of full KV blocks: equal hash <=> equal tokens from the very first one.

hash_i = blake2b(hash_{i-1} || extra_key || tokens of block i). The extra key
carries whatever else changes the KV (a tenant's cache salt; the content hashes of the
media whose placeholder tokens the block holds, ``BlockKeys``), so two requests share
blocks only when it matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class BlockKeys(Protocol):
    """An extra key that differs per block (media: the hashes of the items whose
    placeholders block i covers; ``multimodal/prefix_keys.py``)."""

    def key(self, block: int, block_size: int) -> bytes: ...


BlockKey = bytes | BlockKeys
"""One extra key for every block, or one per block."""


def block_hash(parent: bytes | None, tokens: Sequence[int], extra_key: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(len(extra_key).to_bytes(4, "little") + extra_key)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def extend_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    extra_key: BlockKey,
) -> None:
    """Append the hashes of every full block within the first ``num_tokens`` tokens."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        key = extra_key if isinstance(extra_key, bytes) else extra_key.key(i, block_size)
        hashes.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], key))
