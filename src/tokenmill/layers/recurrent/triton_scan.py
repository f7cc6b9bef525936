"""The recurrent scans in Triton (CUDA; on CPU tensors only under ``TRITON_INTERPRET=1``,
for tests): the gated delta rule and Mamba2's SSD, one decode step and a whole sequence.

Imported only through ``scan.triton_scan`` (``import tokenmill`` never imports triton).

- ``delta_step`` / ``ssd_step``: one token per sequence, in place in the state pool
  (sequence b's state at slot ``slots[b]``; ``keep[b] == 0`` starts it from zeros). A
  program owns one (sequence, head) and a block of the state's columns (V for the delta
  rule, the rows P for SSD): the columns do not mix, so blocks never talk.
- ``delta_scan`` / ``ssd_scan``: one sequence's tokens, the state held in registers while a
  program walks the tokens in order (the "fused recurrent" form: parallel over heads and
  column blocks, serial over tokens), the interface of ``chunked_keeping``. States to keep
  part-way split the sequence into segments, one launch each. ``lead`` and ``chunk`` only
  align the reference's chunks and change nothing here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_step_kernel(
    q, k, v, g, beta, states, slot_stride, slots, keep, out, heads, group,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Program (b * heads + h, j): columns [j BV, (j + 1) BV) of sequence b's head h. q, k
    [B, heads / group, DK], v, out [B, heads, DV], g, beta [B, heads] contiguous."""
    pair = tl.program_id(0).to(tl.int64)
    b, h = pair // heads, pair % heads
    rows = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    row_ok, col_ok = rows < DK, cols < DV
    ok = row_ok[:, None] & col_ok[None, :]
    base = states + tl.load(slots + b) * slot_stride + h * DK * DV
    at = base + rows[:, None] * DV + cols[None, :]
    s = tl.load(at, mask=ok, other=0.0)
    s = tl.where(tl.load(keep + b) != 0.0, s, 0.0)
    qk = (b * (heads // group) + h // group) * DK
    qv = tl.load(q + qk + rows, mask=row_ok, other=0.0)
    kv = tl.load(k + qk + rows, mask=row_ok, other=0.0)
    vv = tl.load(v + pair * DV + cols, mask=col_ok, other=0.0)
    s = s * tl.exp(tl.load(g + pair))
    delta = (vv - tl.sum(s * kv[:, None], axis=0)) * tl.load(beta + pair)
    s = s + kv[:, None] * delta[None, :]
    tl.store(at, s, mask=ok)
    tl.store(out + pair * DV + cols, tl.sum(s * qv[:, None], axis=0), mask=col_ok)


@triton.jit
def _delta_scan_kernel(
    q, k, v, g, beta, s_in, s_out, out, length, sq_h, sq_t, sv_h, sv_t, sg_h, sg_t, so_h,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Program (h, j): columns [j BV, (j + 1) BV) of head h over ``length`` tokens. q, k
    [H, L, DK] (strides sq_h, sq_t, 1), v [H, L, DV] (sv_h, sv_t, 1), g, beta [H, L] (sg_h,
    sg_t); s_in, s_out [H, DK, DV] contiguous; out [H, L, DV] (so_h, DV, 1)."""
    h = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BK)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    row_ok, col_ok = rows < DK, cols < DV
    ok = row_ok[:, None] & col_ok[None, :]
    at = h * DK * DV + rows[:, None] * DV + cols[None, :]
    s = tl.load(s_in + at, mask=ok, other=0.0)
    for t in range(length):
        qv = tl.load(q + h * sq_h + t * sq_t + rows, mask=row_ok, other=0.0)
        kv = tl.load(k + h * sq_h + t * sq_t + rows, mask=row_ok, other=0.0)
        vv = tl.load(v + h * sv_h + t * sv_t + cols, mask=col_ok, other=0.0)
        s = s * tl.exp(tl.load(g + h * sg_h + t * sg_t))
        delta = (vv - tl.sum(s * kv[:, None], axis=0)) * tl.load(beta + h * sg_h + t * sg_t)
        s = s + kv[:, None] * delta[None, :]
        o = tl.sum(s * qv[:, None], axis=0)
        tl.store(out + h * so_h + t * DV + cols, o, mask=col_ok)
    tl.store(s_out + at, s, mask=ok)


@triton.jit
def _ssd_step_kernel(
    x, dt, a, b, c, d, states, slot_stride, slots, keep, y, heads, group,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Program (bi * heads + h, j): rows [j BP, (j + 1) BP) of sequence bi's head h. x, y
    [B, heads, P], dt [B, heads], a, d [heads], b, c [B, heads / group, N] contiguous."""
    pair = tl.program_id(0).to(tl.int64)
    bi, h = pair // heads, pair % heads
    rows = tl.program_id(1) * BP + tl.arange(0, BP)
    cols = tl.arange(0, BN)
    row_ok, col_ok = rows < P, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    at = states + tl.load(slots + bi) * slot_stride + h * P * N + rows[:, None] * N + cols[None, :]
    s = tl.load(at, mask=ok, other=0.0)
    s = tl.where(tl.load(keep + bi) != 0.0, s, 0.0)
    bc = (bi * (heads // group) + h // group) * N
    bv = tl.load(b + bc + cols, mask=col_ok, other=0.0)
    cv = tl.load(c + bc + cols, mask=col_ok, other=0.0)
    xv = tl.load(x + pair * P + rows, mask=row_ok, other=0.0)
    step = tl.load(dt + pair)
    s = s * tl.exp(step * tl.load(a + h)) + (step * xv)[:, None] * bv[None, :]
    tl.store(at, s, mask=ok)
    yv = tl.sum(s * cv[None, :], axis=1) + tl.load(d + h) * xv
    tl.store(y + pair * P + rows, yv, mask=row_ok)


@triton.jit
def _ssd_scan_kernel(
    x, dt, a, b, c, d, s_in, s_out, y, length, sx_h, sx_t, sd_h, sd_t, sb_h, sb_t, sy_h,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """Program (h, j): rows [j BP, (j + 1) BP) of head h over ``length`` tokens. x [H, L, P]
    (sx_h, sx_t, 1), dt [H, L] (sd_h, sd_t), b, c [H, L, N] (sb_h, sb_t, 1); a, d [H];
    s_in, s_out [H, P, N] contiguous; y [H, L, P] (sy_h, P, 1)."""
    h = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BP + tl.arange(0, BP)
    cols = tl.arange(0, BN)
    row_ok, col_ok = rows < P, cols < N
    ok = row_ok[:, None] & col_ok[None, :]
    at = h * P * N + rows[:, None] * N + cols[None, :]
    s = tl.load(s_in + at, mask=ok, other=0.0)
    a_h, d_h = tl.load(a + h), tl.load(d + h)
    for t in range(length):
        xv = tl.load(x + h * sx_h + t * sx_t + rows, mask=row_ok, other=0.0)
        bv = tl.load(b + h * sb_h + t * sb_t + cols, mask=col_ok, other=0.0)
        cv = tl.load(c + h * sb_h + t * sb_t + cols, mask=col_ok, other=0.0)
        step = tl.load(dt + h * sd_h + t * sd_t)
        s = s * tl.exp(step * a_h) + (step * xv)[:, None] * bv[None, :]
        yv = tl.sum(s * cv[None, :], axis=1) + d_h * xv
        tl.store(y + h * sy_h + t * P + rows, yv, mask=row_ok)
    tl.store(s_out + at, s, mask=ok)


def _slot_stride(states: torch.Tensor) -> int:
    assert states.dtype == torch.float32 and (states.shape[0] == 0 or states[0].is_contiguous())
    return states.stride(0)


def delta_step(q, k, v, g, beta, states, slots, keep) -> torch.Tensor:
    """As ``native.recurrent.delta_rule_step``: q, k [B, Hk, K], v [B, H, V], g, beta [B, H],
    states [S, H, K, V] (each slot contiguous), slots [B], keep [B] -> o [B, H, V]."""
    batch, k_heads, dk = k.shape
    heads, dv = v.shape[1:]
    out = torch.empty(batch, heads, dv, dtype=torch.float32, device=v.device)
    if batch == 0:
        return out
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))  # a [BK, BV] tile in registers
    q, k, v, g, beta, keep = (t.float().contiguous() for t in (q, k, v, g, beta, keep))
    grid = (batch * heads, triton.cdiv(dv, bv))
    _delta_step_kernel[grid](
        q, k, v, g, beta, states, _slot_stride(states), slots.contiguous(), keep, out, heads,
        heads // k_heads, DK=dk, DV=dv, BK=bk, BV=bv,
    )  # fmt: skip
    return out


def ssd_step(x, dt, a, b, c, d, states, slots, keep) -> torch.Tensor:
    """As ``native.recurrent.ssd_step``: x [B, H, P], dt [B, H], a, d [H], b, c [B, G, N],
    states [S, H, P, N] (each slot contiguous), slots [B], keep [B] -> y [B, H, P]."""
    batch, heads, p = x.shape
    groups, n = b.shape[1:]
    y = torch.empty(batch, heads, p, dtype=torch.float32, device=x.device)
    if batch == 0:
        return y
    bn = triton.next_power_of_2(n)
    bp = min(triton.next_power_of_2(p), max(1, 8192 // bn))
    x, dt, a, b, c, d, keep = (t.float().contiguous() for t in (x, dt, a, b, c, d, keep))
    grid = (batch * heads, triton.cdiv(p, bp))
    _ssd_step_kernel[grid](
        x, dt, a, b, c, d, states, _slot_stride(states), slots.contiguous(), keep, y, heads,
        heads // groups, P=p, N=n, BP=bp, BN=bn,
    )  # fmt: skip
    return y


def _segments(length: int, keep: tuple[int, ...]) -> list[int]:
    """The ends of the launches: each kept offset inside the sequence, then its end."""
    return sorted({o for o in keep if 0 < o < length} | {length})


def delta_scan(q, k, v, g, beta, state, lead: int = 0, keep: tuple[int, ...] = (),
               chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """``delta_rule.chunked_keeping``: q, k [H, L, K], v [H, L, V] (last dims contiguous),
    g, beta [H, L], state [H, K, V] -> (o [H, L, V], state, the states after each o of
    ``keep``)."""
    heads, length, dk = k.shape
    dv = v.shape[-1]
    out = torch.empty(heads, length, dv, dtype=torch.float32, device=v.device)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))
    q, k, v = _last_contiguous(q, k, v)
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta = g.float(), beta.float()
    if g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    at: dict[int, torch.Tensor] = {0: state}
    start = 0
    for end in _segments(length, keep) if length else ():
        span = slice(start, end)
        new = torch.empty(heads, dk, dv, dtype=torch.float32, device=v.device)
        qs, ks, vs, gs, bs = q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span]
        _delta_scan_kernel[(heads, triton.cdiv(dv, bv))](
            qs, ks, vs, gs, bs, at[start].contiguous(), new, out[:, span], end - start,
            qs.stride(0), qs.stride(1), vs.stride(0), vs.stride(1), gs.stride(0), gs.stride(1),
            out.stride(0), DK=dk, DV=dv, BK=bk, BV=bv,
        )  # fmt: skip
        at[end], start = new, end
    return out, at[start], [at[o] for o in keep]


def ssd_scan(x, dt, a, b, c, d, state, lead: int = 0, keep: tuple[int, ...] = (),
             chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:  # fmt: skip
    """``ssd.chunked_keeping``: x [H, L, P], dt [H, L], a, d [H], b, c [H, L, N] (last dims
    contiguous), state [H, P, N] -> (y [H, L, P], state, the states after each o of
    ``keep``)."""
    heads, length, p = x.shape
    n = b.shape[-1]
    y = torch.empty(heads, length, p, dtype=torch.float32, device=x.device)
    bn = triton.next_power_of_2(n)
    bp = min(triton.next_power_of_2(p), max(1, 8192 // bn))
    x, b, c = _last_contiguous(x, b, c)
    if b.stride() != c.stride():
        b, c = b.contiguous(), c.contiguous()
    a, d = a.float().contiguous(), d.float().contiguous()
    at: dict[int, torch.Tensor] = {0: state}
    start = 0
    for end in _segments(length, keep) if length else ():
        span = slice(start, end)
        new = torch.empty(heads, p, n, dtype=torch.float32, device=x.device)
        xs, ds, bs, cs = x[:, span], dt[:, span], b[:, span], c[:, span]
        _ssd_scan_kernel[(heads, triton.cdiv(p, bp))](
            xs, ds, a, bs, cs, d, at[start].contiguous(), new, y[:, span], end - start,
            xs.stride(0), xs.stride(1), ds.stride(0), ds.stride(1), bs.stride(0), bs.stride(1),
            y.stride(0), P=p, N=n, BP=bp, BN=bn,
        )  # fmt: skip
        at[end], start = new, end
    return y, at[start], [at[o] for o in keep]


def _last_contiguous(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32, the last dim contiguous (the kernels step through it as 1)."""
    return tuple(x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in xs)
