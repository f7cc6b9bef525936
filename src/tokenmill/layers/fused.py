"""When the small per-layer ops (RMSNorm, SiLU-and-mul, rotary) run as fused Triton kernels.

On CUDA each of these ops is several tiny kernels in PyTorch, and at batch 1 under CUDA
graphs their launch cost is a large part of a decode step; ``triton_ops`` fuses each into
one kernel. Nothing here imports triton until a CUDA tensor (or a test) asks for it, so
``import tokenmill`` stays free of it, and CPU tensors keep their PyTorch/native paths.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from tokenmill.attention.backends import triton_interpreted

_forced: bool | None = None  # tests only: set by force_fused()


def fused_ops(x: torch.Tensor) -> ModuleType | None:
    """``tokenmill.layers.triton_ops`` when ``x`` takes the fused kernels, else None:
    CUDA tensors when triton imports (CPU tensors too inside ``force_fused(True)``)."""
    if not (x.is_cuda if _forced is None else _forced):
        return None
    return _triton_ops()


@functools.cache
def _triton_ops() -> ModuleType | None:
    try:
        from tokenmill.layers import triton_ops
    except ImportError:
        return None
    return triton_ops


@contextmanager
def force_fused(enabled: bool) -> Iterator[None]:
    """Tests only: True runs the fused kernels on any tensor (without CUDA, under the Triton
    interpreter: ``TRITON_INTERPRET=1`` set before triton was imported); False keeps every
    tensor, CUDA too, on the PyTorch path (the reference the kernels are checked against)."""
    global _forced
    if enabled and not torch.cuda.is_available() and not triton_interpreted():
        raise RuntimeError("force_fused(True) on CPU needs TRITON_INTERPRET=1 set before triton")
    _forced = enabled
    try:
        yield
    finally:
        _forced = None
