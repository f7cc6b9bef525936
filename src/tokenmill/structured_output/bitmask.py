"""Token bitmasks: allocate them and apply them to logits with plain torch ops.

(llguidance's own torch helper wraps this in ``torch.compile``, whose first call
costs about a minute on CPU.)
"""

from __future__ import annotations

import sys

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, width: int) -> torch.Tensor:
    """[rows, width] int32 on the CPU, every token allowed (all bits set)."""
    return torch.full((rows, width), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, W] int32 -> [M, vocab_size] bool (token t allowed = bit t % 32 of word t // 32).

    Tokens beyond W * 32 are not allowed.
    """
    m, w = bitmask.shape
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts).bitwise_and_(1).view(m, w * 32)  # [M, W*32]
    if w * 32 >= vocab_size:
        return bits[:, :vocab_size].bool()
    allowed = torch.zeros(m, vocab_size, dtype=torch.bool, device=bitmask.device)
    allowed[:, : w * 32] = bits.bool()
    return allowed


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set disallowed tokens to -inf, in place.

    logits [N, V] float; bitmask [M, W] int32 (CPU), one row per entry of ``rows``
    ([M] int64 indices into logits; None: M == N, every row). Each byte of the mask
    looks up its 8 biases (0 or -inf) in a [256, 8] table and the [M, V] bias is
    added: faster on CPU than a boolean ``masked_fill`` of the same size.
    """
    m, w = bitmask.shape
    vocab = logits.shape[1]
    table = _byte_bias(logits.dtype, logits.device)
    index = bitmask.view(torch.uint8).reshape(-1).to(logits.device, torch.int32, non_blocking=True)
    bias = table.index_select(0, index).view(m, w * 32)  # [M, W*32]
    if w * 32 < vocab:  # tokens past the mask are not allowed
        bias = torch.cat([bias, bias.new_full((m, vocab - w * 32), float("-inf"))], dim=1)
    bias = bias[:, :vocab]
    if rows is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, rows.to(logits.device, non_blocking=True), bias)


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, k) is 0 if bit k of byte b is set, else -inf (little-endian words)."""
    key = (dtype, device)
    if key not in _TABLES:
        assert sys.byteorder == "little", "bitmask bytes are read as little-endian int32 words"
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
        table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
        _TABLES[key] = table.to(device, dtype)
    return _TABLES[key]
