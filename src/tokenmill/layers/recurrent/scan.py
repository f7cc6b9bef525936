"""The recurrent layers' scan kernels, chosen once at load (``layers/ops.select_ops``).

A ``ScanKernels`` gives Gated DeltaNet and Mamba2 their four scans:

- ``delta_step`` / ``ssd_step``: one token per sequence, in place in the layer's state pool
  (sequence b's state at slot ``slots[b]``, from zeros where ``keep[b] == 0``) -> the
  step's output. q, k come per k head and B, C per group ([B, Hk, K], [B, G, N]), not
  repeated over the heads they serve.
- ``delta_scan`` / ``ssd_scan``: one sequence's tokens from a state, with the states at
  given offsets kept: the interface of ``delta_rule.chunked_keeping`` / ``ssd.chunked_keeping``.

The PyTorch reference (``delta_rule.py``, ``ssd.py``) is the oracle the others match to
float32 rounding: ``REFERENCE_SCAN`` everywhere, ``NATIVE_SCAN`` (``kernels/recurrent.c``,
the steps; the chunked prefill stays PyTorch's matmuls) on CPU with the native library,
``triton_scan()`` on CUDA. ``TOKENMILL_SCAN_KERNEL`` forces one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill import native
from tokenmill.attention.backends import triton_interpreted
from tokenmill.env import TOKENMILL_SCAN_KERNEL
from tokenmill.layers.recurrent import delta_rule, ssd

StepKernel = Callable[..., torch.Tensor]
"""(per-token inputs..., states [S, H, ...], slots [B], keep [B]) -> output [B, H, ...]."""
SeqKernel = Callable[..., "tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]"]
"""``chunked_keeping``'s: (inputs [H, L, ...]..., state, lead, keep, chunk) -> (out, state,
kept)."""


@dataclass(frozen=True)
class ScanKernels:
    """The four scans of the recurrent layers (see the module docstring)."""

    name: str
    delta_step: StepKernel
    ssd_step: StepKernel
    delta_scan: SeqKernel = delta_rule.chunked_keeping
    ssd_scan: SeqKernel = ssd.chunked_keeping


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, G, D] -> [B, heads, D], each of the G rows serving heads / G heads in a row."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], 1)


def reference_delta_step(q, k, v, g, beta, states, slots, keep) -> torch.Tensor:
    """Gather the slots' states, ``delta_rule.step``, scatter them back."""
    heads = v.shape[1]
    state = states.index_select(0, slots) * keep[:, None, None, None]
    out, state = delta_rule.step(_repeat(q, heads), _repeat(k, heads), v, g, beta, state)
    states.index_copy_(0, slots, state)
    return out


def reference_ssd_step(x, dt, a, b, c, d, states, slots, keep) -> torch.Tensor:
    """Gather the slots' states, ``ssd.step``, scatter them back."""
    heads = x.shape[1]
    state = states.index_select(0, slots) * keep[:, None, None, None]
    y, state = ssd.step(x, dt, a, _repeat(b, heads), _repeat(c, heads), d, state)
    states.index_copy_(0, slots, state)
    return y


REFERENCE_SCAN = ScanKernels("torch", reference_delta_step, reference_ssd_step)


def _native_delta_step(*args: torch.Tensor) -> torch.Tensor:
    from tokenmill.native import recurrent

    return recurrent.delta_rule_step(*args)


def _native_ssd_step(*args: torch.Tensor) -> torch.Tensor:
    from tokenmill.native import recurrent

    return recurrent.ssd_step(*args)


NATIVE_SCAN = ScanKernels("native", _native_delta_step, _native_ssd_step)
"""The fused C steps (one pass pair over each state, no gather / scatter); prefill keeps
the reference's chunked form, whose matmuls are PyTorch's BLAS already."""


def triton_scan() -> ScanKernels:
    """The Triton kernels (``triton_scan.py``; on CPU tensors they need
    ``TRITON_INTERPRET=1``, tests only). Imports triton: an ImportError where it is absent."""
    from tokenmill.layers.recurrent import triton_scan as kernels

    return ScanKernels(
        "triton", kernels.delta_step, kernels.ssd_step, kernels.delta_scan, kernels.ssd_scan
    )


def select_scan(device: torch.device) -> ScanKernels:
    """``TOKENMILL_SCAN_KERNEL`` when set, else: CUDA -> Triton (PyTorch without triton),
    CPU with the native library -> native, otherwise the PyTorch reference. A forced kernel
    that can not run here is a ValueError."""
    wanted = TOKENMILL_SCAN_KERNEL.get()
    if wanted == "torch":
        return REFERENCE_SCAN
    if wanted == "native":
        if device.type != "cpu" or not native.available():
            raise ValueError(
                f"TOKENMILL_SCAN_KERNEL=native needs a CPU model and the native kernels "
                f"(device {device}, native kernels available: {native.available()})"
            )
        return NATIVE_SCAN
    if wanted == "triton":
        if device.type == "cpu" and not triton_interpreted():
            raise ValueError("TOKENMILL_SCAN_KERNEL=triton on CPU needs TRITON_INTERPRET=1")
        return triton_scan()
    if device.type == "cuda":
        try:
            return triton_scan()
        except ImportError:
            return REFERENCE_SCAN
    if device.type == "cpu" and native.available():
        return NATIVE_SCAN
    return REFERENCE_SCAN
