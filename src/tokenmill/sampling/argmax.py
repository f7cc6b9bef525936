"""Row-wise argmax over the vocabulary, fast on CPU.

PyTorch's CPU ``argmax`` over the last dimension runs one thread at a few GB/s (12 ms for
256 rows x 49k logits here). Where the native kernels run, one call does it
(``kernels/argmax.c``: ~10 us a row of 49k logits, against ~0.2 ms for the tensor ops
below at one row). Otherwise, on CPU: ``amax`` is vectorized and parallel, so the
max of each block of ``BLOCK`` logits (amax), the first block holding the row's max
(argmax over a few dozen values), then the first position of the max inside that block.
The result is exactly ``argmax``'s: the first index of the maximum, a NaN counting as the
maximum (amax propagates it into its block), index 0 for a row of -inf.
"""

from __future__ import annotations

import torch

from tokenmill import native

BLOCK = 1024
"""Logits per block: amax over blocks this size is bandwidth-bound; the second pass reads
one block per row."""


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> [R] int64, the same as ``x.argmax(dim=-1)``."""
    rows, vocab = x.shape
    if x.device.type != "cpu" or vocab < 4 * BLOCK or rows == 0:
        return x.argmax(dim=-1)
    if x.dtype == torch.float32 and x.is_contiguous() and native.available():
        return native.argmax_rows(x)
    full = vocab // BLOCK
    block_max = x[:, : full * BLOCK].view(rows, full, BLOCK).amax(dim=-1)  # [R, full]
    if vocab % BLOCK:
        block_max = torch.cat([block_max, x[:, full * BLOCK :].amax(dim=-1, keepdim=True)], 1)
    start = block_max.argmax(dim=-1) * BLOCK  # [R] first index of each row's winning block
    cols = start[:, None] + torch.arange(BLOCK, device=x.device)  # [R, BLOCK]
    inside = x.gather(1, cols.clamp_max(vocab - 1))
    inside.masked_fill_(cols >= vocab, float("-inf"))  # past the end of a short last block
    return start + inside.argmax(dim=-1)
