"""Token bitmasks: allocate them and apply them to logits with plain torch ops.

(llguidance's own torch helper wraps this in ``torch.compile``, whose first call
costs about a minute on CPU.)
"""

from __future__ import annotations

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
    ([M] int64 indices into logits; None: M == N, every row).
    """
    mask = bitmask.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(mask, logits.shape[1])  # [M, V]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = rows.to(logits.device, non_blocking=True)
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
