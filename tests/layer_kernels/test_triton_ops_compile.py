"""The fused Triton layer kernels compile for an H200 (sm_90), here on CPU: RMSNorm on
strided q/k heads, residual add + RMSNorm, SiLU-and-mul, rotary (FMA fusion off, as the
wrapper launches it), as bf16 on the device. See tests/triton_aot.py."""

from __future__ import annotations

import pytest
import torch
from triton_aot import compile_cases, gpu_compiler_missing

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


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    missing = gpu_compiler_missing()
    if missing:
        pytest.skip(f"triton can not compile for NVIDIA GPUs here: {missing}")
    return compile_cases(__file__)


@pytest.mark.parametrize("case", CASES)
def test_layer_kernels_compile_for_sm90(compiled, case):
    result = compiled[case]
    assert "error" not in result, result.get("error")
    assert len(result["kernels"]) == 1 and result["cubin_bytes"][0] > 0
    spills = [u["stack"] for u in result["usage"] if u is not None]
    assert not any(spills), f"registers spilled: {result['usage']}"
