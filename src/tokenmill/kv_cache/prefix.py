"""Chain hashes of full KV blocks: equal hash <=> equal tokens from the very first one.

hash_i = blake2b(hash_{i-1} || extra_key || tokens of block i). The extra key
carries whatever else changes the KV (a tenant's cache salt today; a LoRA
adapter or media later), so two requests share blocks only when it matches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


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
    extra_key: bytes,
) -> None:
    """Append the hashes of every full block within the first ``num_tokens`` tokens."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(
            block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        )
