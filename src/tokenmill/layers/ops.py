"""The kernels every layer uses, chosen once when the model is built.

``select_ops(device, dtype, quant, attention_backend)`` looks at where and how the model
computes and returns an ``Ops``: the attention backend, the ``Kernels`` of the small
per-layer ops (RMSNorm with or without the residual add, SiLU-and-mul, rotary in place)
and the recurrent layers' ``ScanKernels`` (``layers/recurrent/scan.py``: Triton on CUDA,
native on CPU, else the PyTorch reference). Each layer takes the one it needs at
construction; no layer looks at a tensor's device or dtype to pick a kernel.

- CUDA with triton: the fused Triton kernels (``triton_ops.py``), one launch per op instead
  of 2-5 PyTorch kernels (their launch cost dominates a batch-1 decode step under CUDA
  graphs); triton is imported only then, so ``import tokenmill`` stays free of it.
- CPU, float32 activations, quantized weights and the native kernels (``tokenmill.native``):
  the native norm kernels.
- Otherwise PyTorch.

A kernel returns None for a layout it does not take (a strided row, an unsupported
activation width); the layer then runs its PyTorch form, whose numerics the kernels match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill import native
from tokenmill.attention.backends import REFERENCE, AttentionBackend, select_backend
from tokenmill.layers.recurrent.scan import REFERENCE_SCAN, ScanKernels, select_scan
from tokenmill.quant.plan import QuantPlan

NormKernel = Callable[[torch.Tensor, torch.Tensor, float], "torch.Tensor | None"]
"""(x [..., D], scaled weight [D] float32, eps_sum) -> normalized x, or None."""
AddNormKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float], "tuple[torch.Tensor, torch.Tensor] | None"
]
"""(x, residual, scaled weight, eps_sum) -> (normed, residual += x), or None."""


@dataclass(frozen=True)
class Kernels:
    """The small per-layer ops; None: the layers' PyTorch form."""

    name: str
    rms_norm: NormKernel | None = None
    add_rms_norm: AddNormKernel | None = None
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    rotate_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None
    """(x [T, heads, D], cos, sin) -> x rotated in place, or None."""


TORCH_KERNELS = Kernels("torch")


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps_sum: float) -> torch.Tensor | None:
    if x.dim() != 2 or not x.is_contiguous():
        return None  # q/k norms over strided heads: PyTorch
    return native.add_rms_norm(None, x, weight, eps_sum)


def _native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps_sum: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if residual.dim() != 2 or not residual.is_contiguous() or x.shape != residual.shape:
        return None
    return native.add_rms_norm(x.contiguous(), residual, weight, eps_sum), residual


def _native_silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    if x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.float32 or x.shape[1] % 2:
        return None
    return native.silu_and_mul(x)


NATIVE_KERNELS = Kernels(
    "native",
    rms_norm=_native_rms_norm,
    add_rms_norm=_native_add_rms_norm,
    silu_and_mul=_native_silu_and_mul,
)
"""float32 CPU rows in one native call each (the fast norm form, ``exact=False``)."""


def triton_kernels() -> Kernels:
    """The fused Triton kernels (on CPU tensors they need ``TRITON_INTERPRET=1``, tests
    only). Each call looks the kernel up in ``triton_ops`` when it runs."""
    from tokenmill.layers import triton_ops

    return Kernels(
        "triton",
        rms_norm=lambda x, w, m: triton_ops.rms_norm(x, w, m),
        add_rms_norm=lambda x, r, w, m: triton_ops.add_rms_norm(x, r, w, m),
        silu_and_mul=lambda x: triton_ops.silu_and_mul(x),
        rotate_=lambda x, cos, sin: triton_ops.rotate_(x, cos, sin),
    )


@dataclass(frozen=True)
class Ops:
    """What one model's layers run: the attention backend, the small-op kernels and the
    recurrent layers' scans."""

    backend: AttentionBackend = REFERENCE
    kernels: Kernels = TORCH_KERNELS
    scan: ScanKernels = REFERENCE_SCAN


DEFAULT_OPS = Ops()
"""PyTorch everywhere, reference attention: what a layer built without ``ops`` uses."""


def select_ops(
    device: torch.device | str,
    dtype: torch.dtype,
    quant: QuantPlan | None = None,
    attention_backend: str = "auto",
) -> Ops:
    """The one selection for a model on ``device`` computing in ``dtype`` with weights
    ``quant`` (None: dense). Raises ``InvalidRequestError`` (a ValueError) when the asked
    backend can not run this model, never switching to another one."""
    device = torch.device(device)
    backend = select_backend(attention_backend, device, dtype, quant is not None)
    return Ops(backend, _kernels(device, dtype, quant), select_scan(device))


def _kernels(device: torch.device, dtype: torch.dtype, quant: QuantPlan | None) -> Kernels:
    if device.type == "cuda":
        try:
            return triton_kernels()
        except ImportError:
            return TORCH_KERNELS
    if device.type == "cpu" and quant is not None and dtype == torch.float32 and native.available():
        return NATIVE_KERNELS
    return TORCH_KERNELS
