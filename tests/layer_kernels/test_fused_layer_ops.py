"""The fused Triton layer ops (``layers/triton_ops.py``) against the PyTorch paths of the same
layer classes: float32 on CPU under the interpreter (tight), bfloat16 compiled on CUDA."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.layers import triton_ops  # noqa: E402
from tokenmill.layers.activation import GatedActivation  # noqa: E402
from tokenmill.layers.norm import RMSNorm  # noqa: E402
from tokenmill.layers.ops import Ops, triton_kernels  # noqa: E402
from tokenmill.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _tol(device: torch.device) -> dict[str, float]:
    # bfloat16: the PyTorch path rounds 2-3 times, the fused kernel once.
    return {"atol": 1e-5, "rtol": 1e-5} if device.type == "cpu" else {"atol": 3e-2, "rtol": 3e-2}


TORCH, FUSED = Ops(), Ops(kernels=triton_kernels())
"""The layers' PyTorch forms; the fused kernels (any tensor: on CPU interpreted)."""


def _both(fn: Callable[[Ops], object]) -> tuple[object, object]:
    """(PyTorch path, fused path) of the same call, on layers built with each selection."""
    return fn(TORCH), fn(FUSED)


def _norm(dim: int, unit_offset: bool, device: torch.device) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, unit_offset, _dtype(device), exact=False).to(device)
    norm.weight.data.copy_(torch.randn(dim) * 0.3 + (0.0 if unit_offset else 1.0))
    return norm


def _with(norm: RMSNorm, ops: Ops) -> RMSNorm:
    """The same norm (same weight) built with ``ops``."""
    twin = RMSNorm(norm.weight.shape[0], norm.eps, norm.unit_offset, norm.weight.dtype,
                   exact=False, ops=ops).to(norm.weight.device)  # fmt: skip
    twin.weight.data.copy_(norm.weight)
    return twin


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (3, 4000), (2, 3, 80)])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm(device, shape, unit_offset):
    torch.manual_seed(0)
    norm = _norm(shape[-1], unit_offset, device)
    x = torch.randn(shape, device=device).to(_dtype(device)) * 3
    x[0, ..., :] = 0  # a zero row stays zero (eps in the root)
    want, got = _both(lambda ops: _with(norm, ops)(x))
    torch.testing.assert_close(got.float(), want.float(), **_tol(device))
    assert got.dtype == x.dtype and not got[0].any()


@pytest.mark.parametrize("shape", [(1, 64), (5, 576), (3, 4000)])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_add_rms_norm_updates_residual_in_place(device, shape, unit_offset):
    torch.manual_seed(1)
    norm = _norm(shape[-1], unit_offset, device)
    x = torch.randn(shape, device=device).to(_dtype(device))
    residual = torch.randn(shape, device=device).to(_dtype(device))
    results = []
    for ops in (TORCH, FUSED):
        res = residual.clone()
        normed, out_res = _with(norm, ops).forward_residual(x, res)
        assert out_res is res
        results.append((normed, res))
    (want, want_res), (got, got_res) = results
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # one rounding of x + r
    torch.testing.assert_close(got.float(), want.float(), **_tol(device))


def test_rms_norm_of_strided_heads(device):
    """q/k norms read heads of the packed qkv projection: [T, H, D] with a row stride."""
    torch.manual_seed(2)
    tokens, heads, kv_heads, d = 3, 4, 2, 64
    norm = _norm(d, False, device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=device).to(_dtype(device))
    q = qkv[:, : heads * d].view(tokens, heads, d)
    want, got = _both(lambda ops: _with(norm, ops)(q))
    torch.testing.assert_close(got.float(), want.float(), **_tol(device))


@pytest.mark.parametrize("shape", [(1, 128), (5, 1152), (3, 4096), (2, 3, 80)])
def test_silu_and_mul(device, shape):
    torch.manual_seed(3)
    x = torch.randn(shape, device=device).to(_dtype(device)) * 4
    want, got = _both(lambda ops: GatedActivation("silu", ops)(x))
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got.float(), want.float(), **_tol(device))


def test_other_activations_keep_pytorch(device, monkeypatch):
    calls = []
    monkeypatch.setattr(triton_ops, "silu_and_mul", lambda x: calls.append(x))
    x = torch.randn(2, 64, device=device)
    GatedActivation("gelu_pytorch_tanh", FUSED)(x)
    assert not calls


@pytest.mark.parametrize("head_dim", [64, 48, 128])
def test_rotary_in_place_is_bit_identical(device, head_dim):
    """Each product and the sum are rounded as the PyTorch path rounds them: equal bits."""
    torch.manual_seed(4)
    tokens, heads, kv_heads = 5, 4, 2
    rope = RopeConfig(theta=500000.0, scaling="llama3", factor=8.0)
    rotaries = [RotaryEmbedding(head_dim, 256, rope, _dtype(device), ops).to(device)
                for ops in (TORCH, FUSED)]  # fmt: skip
    tables = rotaries[0].tables(torch.randint(0, 256, (tokens,), device=device))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, device=device).to(_dtype(device))
    results = []
    for rotary in rotaries:
        packed = qkv.clone()
        qk = packed[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        assert rotary.rotate_(qk, tables) is qk
        results.append(packed)
    torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)  # v untouched too


def test_cpu_layers_never_import_triton():
    """``import tokenmill`` and the CPU paths of the layers stay free of triton."""
    code = (
        "import sys, torch, tokenmill\n"
        "from tokenmill.layers.activation import GatedActivation\n"
        "from tokenmill.layers.norm import RMSNorm\n"
        "norm = RMSNorm(8, 1e-6, dtype=torch.float32, exact=False)\n"
        "norm.weight.data.fill_(1.0)\n"
        "norm.forward_residual(torch.ones(2, 8), torch.ones(2, 8))\n"
        "GatedActivation('silu')(torch.ones(2, 8))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
