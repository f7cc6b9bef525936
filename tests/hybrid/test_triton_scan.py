"""The Triton scans (layers/recurrent/triton_scan.py) against the PyTorch reference: the
decode steps in place in a state pool and the whole-sequence scans with kept states, for
the gated delta rule and Mamba2's SSD, on random shapes with odd head dims.

On CPU they run under Triton's interpreter (float32, tight tolerance); the ``gpu``
variants compile for CUDA. There is no GPU in CI: the CUDA path is checked interpreted."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from tokenmill.layers.recurrent import delta_rule, ssd  # noqa: E402
from tokenmill.layers.recurrent import triton_scan as kernels  # noqa: E402
from tokenmill.layers.recurrent.scan import (  # noqa: E402
    reference_delta_step,
    reference_ssd_step,
)

# (batch, heads, q/k heads or groups, K or P, V or N)
SHAPES = [(1, 1, 1, 1, 1), (3, 4, 2, 19, 37), (2, 2, 1, 64, 130)]
GATES = {"mixed": (-3.0, 0.0), "near one": (-1e-6, 0.0), "near zero": (-1e4, -60.0)}


def _tol(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4


def _gate(gen, shape, gate):
    low, high = GATES[gate]
    return low + (high - low) * torch.rand(*shape, generator=gen)


def _delta_step_inputs(gen, batch, heads, k_heads, dk, dv, gate):
    q = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk, generator=gen)) * dk**-0.5
    k = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk, generator=gen))
    v = torch.randn(batch, heads, dv, generator=gen)
    return q, k, v, _gate(gen, (batch, heads), gate), torch.rand(batch, heads, generator=gen)


def _ssd_step_inputs(gen, batch, heads, groups, p, n, gate):
    x = torch.randn(batch, heads, p, generator=gen)
    dt = 0.1 + 0.9 * torch.rand(batch, heads, generator=gen)
    b, c = (
        torch.randn(batch, groups, n, generator=gen),
        torch.randn(batch, groups, n, generator=gen),
    )
    return x, dt, _gate(gen, (heads,), gate), b, c, torch.randn(heads, generator=gen)


@pytest.mark.parametrize("kind", ["delta", "ssd"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("shape", SHAPES)
def test_step_matches_reference(device, kind, shape, gate):
    batch, heads, groups, rows, cols = shape
    gen = torch.Generator().manual_seed(batch * 100 + rows)
    cache = torch.randn(batch + 2, 5 + heads * rows * cols, generator=gen)
    ref_cache = cache.clone()
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    make = _delta_step_inputs if kind == "delta" else _ssd_step_inputs
    step = kernels.delta_step if kind == "delta" else kernels.ssd_step
    reference = reference_delta_step if kind == "delta" else reference_ssd_step
    on = cache.to(device)
    states = on[:, 5:].view(batch + 2, heads, rows, cols)
    ref_states = ref_cache[:, 5:].view(states.shape)
    for i in range(3):  # the state carried across calls; the first call's odd slots fresh
        keep = torch.ones(batch) if i else (torch.arange(batch) % 2).float()
        inputs = make(gen, batch, heads, groups, rows, cols, gate)
        want = reference(*inputs, ref_states, slots, keep)
        out = step(*(t.to(device) for t in inputs), states, slots.to(device), keep.to(device))
        tol = _tol(device)
        torch.testing.assert_close(out.cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(on.cpu(), ref_cache, rtol=tol, atol=tol)


def _delta_seq(gen, heads, length, dk, dv, gate):
    q = delta_rule.l2_normalize(torch.randn(length, heads, dk, generator=gen)) * dk**-0.5
    k = delta_rule.l2_normalize(torch.randn(length, heads, dk, generator=gen))
    v = torch.randn(length, heads, dv, generator=gen)
    g, beta = _gate(gen, (length, heads), gate), torch.rand(length, heads, generator=gen)
    # the layer's layout: [L, H, D] transposed to [H, L, D], [L, H] to [H, L]
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.T, beta.T


def _ssd_seq(gen, heads, length, p, n, gate):
    x = torch.randn(length, heads, p, generator=gen).transpose(0, 1)
    dt = (0.1 + 0.9 * torch.rand(length, heads, generator=gen)).T
    a, d = _gate(gen, (heads,), gate), torch.randn(heads, generator=gen)
    b = torch.randn(length, heads, n, generator=gen).transpose(0, 1)
    c = torch.randn(length, heads, n, generator=gen).transpose(0, 1)
    return x, dt, a, b, c, d


@pytest.mark.parametrize("kind", ["delta", "ssd"])
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize(
    ("heads", "length", "rows", "cols", "keep"),
    [
        (1, 1, 1, 1, ()),
        (3, 11, 19, 37, (4, 11)),
        (2, 23, 8, 130, (0, 5, 16, 17)),
        (2, 9, 64, 16, ()),
    ],
)
def test_sequence_scan_matches_chunked_reference(
    device, kind, gate, heads, length, rows, cols, keep
):
    gen = torch.Generator().manual_seed(length * 10 + rows)
    make = _delta_seq if kind == "delta" else _ssd_seq
    scan = kernels.delta_scan if kind == "delta" else kernels.ssd_scan
    reference = delta_rule.chunked_keeping if kind == "delta" else ssd.chunked_keeping
    inputs = make(gen, heads, length, rows, cols, gate)
    state = torch.randn(heads, rows, cols, generator=gen)
    tol = _tol(device)
    for lead in (0, 3):  # chunks starting before the sequence: the reference's alignment only
        want, want_state, want_kept = reference(*inputs, state, lead, keep, 8)
        out, new, kept = scan(*(t.to(device) for t in inputs), state.to(device), lead, keep, 8)
        torch.testing.assert_close(out.cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(new.cpu(), want_state, rtol=tol, atol=tol)
        assert len(kept) == len(keep)
        for got, wanted in zip(kept, want_kept):
            torch.testing.assert_close(got.cpu(), wanted, rtol=tol, atol=tol)
    assert state.isfinite().all()  # the start state is read, never written


def test_scan_carries_state_across_calls(device):
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta = _delta_seq(gen, 2, 30, 16, 24, "mixed")
    state = torch.randn(2, 16, 24, generator=gen)
    on = [t.to(device) for t in (q, k, v, g, beta)]
    whole, end, _ = kernels.delta_scan(*on, state.to(device))
    first, mid, _ = kernels.delta_scan(*(t[:, :13] for t in on), state.to(device))
    second, end2, _ = kernels.delta_scan(*(t[:, 13:] for t in on), mid)
    assert torch.equal(torch.cat([first, second], 1), whole)  # token-serial: the same bits
    assert torch.equal(end2, end)
