"""One decode step of the recurrent layers' scans (``kernels/recurrent.c``), in place in a
layer's state pool: the gated delta rule (Gated DeltaNet) and Mamba2's SSD.

Each wrapper takes float32 CPU tensors, makes the small per-token inputs contiguous, and
returns the step's output; the states of the batch's slots are updated where they are.
"""

from __future__ import annotations

import torch

from tokenmill import native


def _c(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()


def _slot_stride(states: torch.Tensor) -> int:
    """Floats from one slot's state to the next; within a slot the state must be contiguous
    (a layer's ``RecurrentState.split`` view of its cache is)."""
    assert states.dtype == torch.float32 and states.device.type == "cpu"
    inner = states[0].is_contiguous() if states.shape[0] else True
    assert inner, "each slot's state must be contiguous"
    return states.stride(0)


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """q, k [B, Hk, K] (Hk divides H), v [B, H, V], g, beta [B, H]; states [S, H, K, V]
    float32 (each slot contiguous), slots [B] int64, keep [B] (0: the slot starts from
    zeros) -> o [B, H, V]; states[slots] advanced one token."""
    batch, k_heads, dk = k.shape
    heads, dv = v.shape[1:]
    assert states.shape[1:] == (heads, dk, dv) and heads % k_heads == 0
    q, k, v, g, beta, keep = map(_c, (q, k, v, g, beta, keep))
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(batch, heads, dv, dtype=torch.float32)
    native._need().delta_rule_step(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
        states.data_ptr(), _slot_stride(states), slots.data_ptr(), keep.data_ptr(), batch,
        heads, k_heads, dk, dv,
        out.data_ptr(),
    )  # fmt: skip
    return out


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
) -> torch.Tensor:
    """x [B, H, P], dt [B, H], a, d [H], b, c [B, G, N] (G divides H); states [S, H, P, N]
    float32 (each slot contiguous), slots [B] int64, keep [B] -> y [B, H, P];
    states[slots] advanced one token."""
    batch, heads, head_dim = x.shape
    groups, n_state = b.shape[1:]
    assert states.shape[1:] == (heads, head_dim, n_state) and heads % groups == 0
    x, dt, a, b, c, d, keep = map(_c, (x, dt, a, b, c, d, keep))
    slots = slots.to(torch.int64).contiguous()
    y = torch.empty(batch, heads, head_dim, dtype=torch.float32)
    native._need().ssd_step(
        x.data_ptr(), dt.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(),
        states.data_ptr(), _slot_stride(states), slots.data_ptr(), keep.data_ptr(), batch,
        heads, groups, head_dim, n_state, y.data_ptr(),
    )  # fmt: skip
    return y
