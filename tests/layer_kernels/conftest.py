"""The fused layer kernels run on CPU tensors under the Triton interpreter (numpy) when there
is no CUDA device. ``@triton.jit`` picks interpreted or compiled when the kernel module is
imported, so the switch is set here, before any test imports triton; with CUDA the kernels
compile and only the ``gpu`` variants run (as in tests/attention)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreted() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """cpu: interpreted kernels, float32 (tight tolerance); cuda: compiled, bfloat16."""
    pytest.importorskip("triton")
    if request.param == "cpu" and not _interpreted():
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1")
    if request.param == "cuda" and (not torch.cuda.is_available() or _interpreted()):
        pytest.skip("needs a CUDA device and compiled (not interpreted) Triton kernels")
    return torch.device(request.param)
