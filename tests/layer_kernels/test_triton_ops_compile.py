"""The fused Triton layer kernels compile for an H200 (sm_90), here on CPU: RMSNorm on
strided q/k heads, residual add + RMSNorm, SiLU-and-mul, rotary (FMA fusion off, as the
wrapper launches it), as bf16 on the device. See tests/triton_aot.py."""

from __future__ import annotations

import pytest
import torch
from triton_aot import assert_builds

BF16 = torch.bfloat16


def rms_norm_heads() -> None:
    from tokenmill.layers import triton_ops

    triton_ops.rms_norm(torch.zeros(3, 40, 128, dtype=BF16)[:, 4:12], torch.ones(128), 1e-6)


def add_rms_norm() -> None:
    from tokenmill.layers import triton_ops

    x, residual = torch.zeros(3, 4096, dtype=BF16), torch.zeros(3, 4096, dtype=BF16)
    triton_ops.add_rms_norm(x, residual, torch.ones(4096), 1e-6)


def silu_and_mul() -> None:
    from tokenmill.layers import triton_ops

    triton_ops.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=BF16))


def rotary() -> None:
    from tokenmill.layers import triton_ops

    cos, sin = torch.zeros(3, 1, 128, dtype=BF16), torch.zeros(3, 1, 128, dtype=BF16)
    triton_ops.rotate_(torch.zeros(3, 40, 128, dtype=BF16)[:, :32], cos, sin)


CASES = {f.__name__: f for f in (rms_norm_heads, add_rms_norm, silu_and_mul, rotary)}
KERNEL = {"rms_norm_heads": "_rms_norm_kernel", "add_rms_norm": "_rms_norm_kernel",
          "silu_and_mul": "_silu_and_mul_kernel", "rotary": "_rotary_kernel"}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_layer_kernels_compile_for_sm90(sm90_build, case):
    assert_builds(sm90_build[case], [KERNEL[case]])
