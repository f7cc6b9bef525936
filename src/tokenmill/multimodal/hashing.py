"""Content hashes of processed media: equal hash <=> the same encoder input."""

from __future__ import annotations

import hashlib

import torch


def content_hash(modality: str, pixels: torch.Tensor, grid: tuple[int, ...]) -> bytes:
    """blake2b over the modality, the grid and the processed tensor's bytes (16 bytes).

    Hashing what the encoder sees (not the file) makes two encodings of one picture, or
    one picture resized by different options, hash as what they are to the model."""
    h = hashlib.blake2b(digest_size=16)
    h.update(modality.encode() + b"\0")
    h.update(repr(tuple(grid)).encode() + str(pixels.dtype).encode())
    h.update(pixels.contiguous().numpy().tobytes())
    return h.digest()
