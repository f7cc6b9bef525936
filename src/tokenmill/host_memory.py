"""Keep freed host memory in the process for the next step (glibc's malloc).

A prefill step allocates tensors of megabytes (a 2000-token chunk's MLP input alone is
25 MB) and frees them at the step's end. With glibc's defaults such a block is a fresh
memory map, or the heap's top is handed back to the OS once it is free, so the next step
takes a page fault and the kernel's zeroing for every 4 KB it writes: measured on
SmolLM2-135M bf16 (2 cores), a 32-prompt prefill spent about a sixth of its time there.
Serving it from a heap that keeps up to ``TRIM_BYTES`` free instead costs that much
resident memory at most.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import TYPE_CHECKING

from tokenmill.env import TOKENMILL_HOST_MALLOC

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_BYTES = 32 << 20
"""Blocks at least this big still get their own map (glibc's largest threshold)."""
TRIM_BYTES = 256 << 20
"""Free memory the heap keeps at its top before returning it to the OS."""

KEEP_BYTES = 16 << 20
"""A scratch buffer kept across steps (the decode layers', the greedy head's) up to this
size whatever the steps need; a larger one is replaced once a step needs less than
1 / SHRINK of it (no reallocation while sizes move within that factor, as they do from
step to step), so one long or wide step does not hold its buffers for the engine's life."""
SHRINK = 8


def oversized(held: torch.Tensor, size: int) -> bool:
    """Whether the kept buffer ``held`` is to be replaced by one of ``size`` elements."""
    return held.numel() * held.element_size() > KEEP_BYTES and held.numel() >= SHRINK * size


_done = False


def keep_freed_memory() -> bool:
    """Raise glibc's map and trim thresholds once per process (Linux, unless
    TOKENMILL_HOST_MALLOC=0). True when they are set."""
    global _done
    if _done:
        return True
    if not TOKENMILL_HOST_MALLOC.get() or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    if _done:
        logger.debug(
            "malloc: maps from %d MB, trim above %d MB", MMAP_BYTES >> 20, TRIM_BYTES >> 20
        )
    return _done
