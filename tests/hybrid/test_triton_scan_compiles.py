"""The Triton scan kernels compile for an H200 (sm_90), here on CPU, without register
spills: the delta-rule step and sequence scan at Qwen3.5's head shapes (K = V = 128) and
an odd one, Mamba2's SSD step and scan at Mamba2's (P = 64, N = 128) and Falcon-H1's
(N = 256). The interpreted tests (test_triton_scan.py) check what they compute; see
tests/triton_aot.py."""

from __future__ import annotations

import functools

import pytest
import torch
from triton_aot import assert_builds


def delta(batch: int, heads: int, k_heads: int, dk: int, dv: int, step: bool) -> None:
    from tokenmill.layers.recurrent import triton_scan

    if step:
        states = torch.zeros(batch + 1, 7 + heads * dk * dv)[:, 7:].view(-1, heads, dk, dv)
        q, k = torch.zeros(batch, k_heads, dk), torch.zeros(batch, k_heads, dk)
        v, g, beta = (
            torch.zeros(batch, heads, dv),
            torch.zeros(batch, heads),
            torch.zeros(batch, heads),
        )
        triton_scan.delta_step(q, k, v, g, beta, states, torch.arange(batch), torch.ones(batch))
    else:
        length = 20
        q, k = (
            torch.zeros(length, heads, dk).transpose(0, 1),
            torch.zeros(length, heads, dk).transpose(0, 1),
        )
        v = torch.zeros(length, heads, dv).transpose(0, 1)
        g, beta = torch.zeros(length, heads).T, torch.zeros(length, heads).T
        triton_scan.delta_scan(q, k, v, g, beta, torch.zeros(heads, dk, dv), keep=(7,))


def ssd(batch: int, heads: int, groups: int, p: int, n: int, step: bool) -> None:
    from tokenmill.layers.recurrent import triton_scan

    a, d = torch.zeros(heads), torch.zeros(heads)
    if step:
        states = torch.zeros(batch + 1, 5 + heads * p * n)[:, 5:].view(-1, heads, p, n)
        x, dt = torch.zeros(batch, heads, p), torch.zeros(batch, heads)
        b, c = torch.zeros(batch, groups, n), torch.zeros(batch, groups, n)
        triton_scan.ssd_step(x, dt, a, b, c, d, states, torch.arange(batch), torch.ones(batch))
    else:
        length = 20
        x, dt = torch.zeros(length, heads, p).transpose(0, 1), torch.zeros(length, heads).T
        b, c = (
            torch.zeros(length, heads, n).transpose(0, 1),
            torch.zeros(length, heads, n).transpose(0, 1),
        )
        triton_scan.ssd_scan(x, dt, a, b, c, d, torch.zeros(heads, p, n), keep=(7,))


CASES = {
    "delta-step-qwen3.5": functools.partial(delta, 4, 16, 16, 128, 128, True),
    "delta-step-odd": functools.partial(delta, 3, 4, 2, 19, 37, True),
    "delta-scan-qwen3.5": functools.partial(delta, 1, 16, 16, 128, 128, False),
    "ssd-step-mamba2": functools.partial(ssd, 4, 32, 1, 64, 128, True),
    "ssd-step-falcon-h1": functools.partial(ssd, 2, 24, 1, 64, 256, True),
    "ssd-scan-mamba2": functools.partial(ssd, 1, 32, 1, 64, 128, False),
}
EXPECTED = {
    name: ["_delta_step_kernel"] if name.startswith("delta-step")
    else ["_delta_scan_kernel"] * 2 if name.startswith("delta-scan")
    else ["_ssd_step_kernel"] if name.startswith("ssd-step")
    else ["_ssd_scan_kernel"] * 2
    for name in CASES
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_scan_kernels_compile_for_sm90(sm90_build, case):
    assert_builds(sm90_build[case], EXPECTED[case])
