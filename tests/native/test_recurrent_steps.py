"""The native decode steps of the recurrent scans (kernels/recurrent.c) at every ISA level
this CPU runs against the PyTorch reference (``layers/recurrent/scan.py``'s gather, step,
scatter): random shapes with odd head dims, grouped heads, scattered slots, fresh slots,
the state carried over several calls, decays near 1 and near 0; a token's result does not
depend on its batch, and both ISA levels give the same bits."""

from __future__ import annotations

import zlib

import pytest
import torch

from tokenmill import native
from tokenmill.layers.recurrent import delta_rule
from tokenmill.layers.recurrent.scan import reference_delta_step, reference_ssd_step
from tokenmill.native import recurrent

# (batch, heads, q/k heads or groups, K or P, V or N)
SHAPES = [
    (1, 1, 1, 1, 1),
    (3, 4, 2, 19, 37),
    (2, 6, 3, 7, 16),
    (5, 2, 2, 33, 5),
    (2, 4, 1, 128, 128),
]
GATES = {"mixed": (-3.0, 0.0), "near one": (-1e-6, 0.0), "near zero": (-1e4, -60.0)}


def _delta_inputs(gen, batch, heads, k_heads, dk, dv, gate):
    low, high = GATES[gate]
    q = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk, generator=gen)) * dk**-0.5
    k = delta_rule.l2_normalize(torch.randn(batch, k_heads, dk, generator=gen))
    v = torch.randn(batch, heads, dv, generator=gen)
    g = low + (high - low) * torch.rand(batch, heads, generator=gen)
    beta = torch.rand(batch, heads, generator=gen)
    return q, k, v, g, beta


def _ssd_inputs(gen, batch, heads, groups, p, n, gate):
    low, high = GATES[gate]
    x = torch.randn(batch, heads, p, generator=gen)
    dt = 0.1 + 0.9 * torch.rand(batch, heads, generator=gen)
    a = low + (high - low) * torch.rand(heads, generator=gen)  # dt a: the gate's range
    b, c = (
        torch.randn(batch, groups, n, generator=gen),
        torch.randn(batch, groups, n, generator=gen),
    )
    d = torch.randn(heads, generator=gen)
    return x, dt, a, b, c, d


def _pool(gen, slots, heads, rows, cols, extra=3):
    """A layer's cache [slots, extra + heads rows cols] and its state view [slots, heads,
    rows, cols] (each slot contiguous, slot stride > its size: ``RecurrentState.split``)."""
    cache = torch.randn(slots, extra + heads * rows * cols, generator=gen)
    return cache, cache[:, extra:].view(slots, heads, rows, cols)


def _check_steps(kind, shape, gate, steps=4):
    batch, heads, groups, rows, cols = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, shape, gate)).encode()))
    cache, states = _pool(gen, batch + 3, heads, rows, cols)
    ref_cache = cache.clone()
    ref_states = ref_cache[:, 3:].view(states.shape)
    slots = torch.randperm(batch + 3, generator=gen)[:batch]
    for i in range(steps):
        keep = torch.ones(batch) if i else (torch.arange(batch) % 2).float()  # fresh slots
        if kind == "delta":
            inputs = _delta_inputs(gen, batch, heads, groups, rows, cols, gate)
            out = recurrent.delta_rule_step(*inputs, states, slots, keep)
            want = reference_delta_step(*inputs, ref_states, slots, keep)
        else:
            inputs = _ssd_inputs(gen, batch, heads, groups, rows, cols, gate)
            out = recurrent.ssd_step(*inputs, states, slots, keep)
            want = reference_ssd_step(*inputs, ref_states, slots, keep)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)  # other slots too


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("shape", SHAPES)
def test_delta_rule_step_matches_reference(native_level, shape, gate) -> None:
    _check_steps("delta", shape, gate)


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("shape", SHAPES)
def test_ssd_step_matches_reference(native_level, shape, gate) -> None:
    _check_steps("ssd", shape, gate)


def _run_alone_and_batched(kind, isa):
    """(the batch's outputs and states, each sequence's own run's), at level ``isa``."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, groups, rows, cols = 5, 4, 2, 24, 40
    _, states = _pool(gen, batch, heads, rows, cols, extra=0)
    make = _delta_inputs if kind == "delta" else _ssd_inputs
    step = recurrent.delta_rule_step if kind == "delta" else recurrent.ssd_step
    inputs = make(gen, batch, heads, groups, rows, cols, "mixed")
    keep, slots = torch.ones(batch), torch.arange(batch)
    with native.use(isa):
        alone = []
        for b in range(batch):
            one = [t[b : b + 1] if t.shape[0] == batch and t.dim() > 1 else t for t in inputs]
            mine = states[b : b + 1].clone()
            alone.append((step(*one, mine, slots[:1], keep[:1]), mine))
        together = states.clone()
        out = step(*inputs, together, slots, keep)
    return (out, together), (torch.cat([o for o, _ in alone]), torch.cat([s for _, s in alone]))


@pytest.mark.parametrize("kind", ["delta", "ssd"])
def test_a_sequence_is_independent_of_its_batch(native_level, kind) -> None:
    (out, states), (out_alone, states_alone) = _run_alone_and_batched(kind, native_level)
    assert torch.equal(out, out_alone)
    assert torch.equal(states, states_alone)


@pytest.mark.parametrize("kind", ["delta", "ssd"])
def test_the_same_bits_at_every_level(kind) -> None:
    levels = [lv for lv in native.isas_available() if native.library(lv) is not None]
    if len(levels) < 2:
        pytest.skip("this CPU runs one native ISA level")
    results = [_run_alone_and_batched(kind, lv)[0] for lv in levels]
    for out, states in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(states, results[0][1])
