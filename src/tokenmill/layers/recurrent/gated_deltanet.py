"""Gated DeltaNet (Qwen3.5's linear attention): projections, causal conv, gated delta rule,
gated RMSNorm, output projection; the conv window and the delta state live in a slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import RecurrentState
from tokenmill.layers.linear import Linear, PackedLinear
from tokenmill.layers.recurrent import delta_rule
from tokenmill.layers.recurrent.conv import CausalConv1d
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.layers.recurrent.scan import REFERENCE_SCAN, ScanKernels

# HF's four input projections load into one packed projection, shards in this order.
PACKED_IN_PROJ = {
    "in_proj_qkv": ("in_proj", 0),
    "in_proj_z": ("in_proj", 1),
    "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}


@dataclass(frozen=True)
class DeltaNetShape:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    """A multiple of num_k_heads: each q/k head serves num_v_heads // num_k_heads v heads."""
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


class GatedRMSNorm(nn.Module):
    """y = w * x / rms(x) * silu(z) over each head's values; the norm in float32, rounded to
    x's dtype before the weight (HF's order)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """hidden [T, hidden] -> [T, hidden]; reads and writes this layer's state slots."""

    def __init__(self, shape: DeltaNetShape, layer_idx: int, dtype: torch.dtype,
                 scan: ScanKernels = REFERENCE_SCAN) -> None:  # fmt: skip
        """``scan``: the delta-rule kernels (``ops.scan``, chosen at load)."""
        super().__init__()
        self.shape, self.layer_idx, self.scan = shape, layer_idx, scan
        nv = shape.num_v_heads
        self.in_proj = PackedLinear(
            shape.hidden_size, [shape.conv_dim, shape.value_dim, nv, nv], False, dtype
        )
        self.conv1d = CausalConv1d(shape.conv_dim, shape.conv_kernel, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(nv, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(nv, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(shape.head_v_dim, shape.eps, dtype)
        self.out_proj = Linear(shape.value_dim, shape.hidden_size, False, dtype)
        self.state_spec = RecurrentState.of(
            self.conv1d.state_shape, (nv, shape.head_k_dim, shape.head_v_dim), dtype=torch.float32
        )
        """The conv window [conv_dim, K - 1] and the delta state [Hv, K, V], float32."""

    def forward(self, hidden: torch.Tensor, ctx: StepContext, plan: StatePlan) -> torch.Tensor:
        s, tokens = self.shape, hidden.shape[0]
        cache = ctx.kv_caches[self.layer_idx]
        assert cache is not None, f"layer {self.layer_idx} has no state slots"
        windows, states = self.state_spec.split(cache)
        mixed, z, b, a = self.in_proj(hidden, ctx).split(
            [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1
        )
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        core = torch.empty(tokens, s.num_v_heads, s.head_v_dim, device=hidden.device)
        if plan.num_singles:
            self._singles(mixed, g, beta, windows, states, plan, core)
        for run in plan.runs:
            self._run(mixed, g, beta, windows, states, run, core, plan)
        normed = self.norm(core.to(hidden.dtype), z.reshape(tokens, s.num_v_heads, s.head_v_dim))
        return self.out_proj(normed.reshape(tokens, s.value_dim), ctx)

    def _qkv(
        self, conv_out: torch.Tensor, expand: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [N, conv_dim] -> q, k [N, Hv, K] (normalized, q scaled; [N, Hk, K]
        unless ``expand``), v [N, Hv, V], float32."""
        s, n = self.shape, conv_out.shape[0]
        q, k, v = F.silu(conv_out).float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q = delta_rule.l2_normalize(q.reshape(n, s.num_k_heads, s.head_k_dim))
        k = delta_rule.l2_normalize(k.reshape(n, s.num_k_heads, s.head_k_dim))
        if group > 1 and expand:
            q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
        return q * s.head_k_dim**-0.5, k, v.reshape(n, s.num_v_heads, s.head_v_dim)

    def _singles(self, mixed, g, beta, windows, states, plan: StatePlan, core) -> None:
        """The one-token sequences together: one conv step and one delta step (in place in
        the states of their slots)."""
        keep = plan.keep
        window = windows.index_select(0, plan.slots) * keep[:, None, None]
        conv_out, window = self.conv1d.forward_step(plan.gather(mixed), window)
        windows.index_copy_(0, plan.slots, window.to(windows.dtype))
        q, k, v = self._qkv(conv_out, expand=False)
        out = self.scan.delta_step(
            q, k, v, plan.gather(g), plan.gather(beta), states, plan.slots, keep
        )
        plan.scatter(core, out)

    def _run(self, mixed, g, beta, windows, states, run, core, plan: StatePlan) -> None:
        """One sequence's tokens: the conv over its window, the chunked delta rule; the
        states of ``run.saves`` go to their snapshot rows, those of ``run.keeps`` (a verify
        step's per-position states) to its rollback rows."""
        rows = slice(run.start, run.end)
        window = None if run.fresh else windows[run.slot]
        kept_windows = None  # taken before the slot's window (which `window` views) changes
        if run.offsets:
            kept_windows = self.conv1d.windows_at(mixed[rows], window, run.offsets)
        conv_out, window = self.conv1d.forward_seq(mixed[rows], window)
        windows[run.slot] = window
        q, k, v = self._qkv(conv_out)
        state = torch.zeros_like(states[run.slot]) if run.fresh else states[run.slot]
        out, state, kept = self.scan.delta_scan(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            g[rows].T, beta[rows].T, state, run.lead(delta_rule.CHUNK), run.offsets,
            run.chunk(delta_rule.CHUNK),
        )  # fmt: skip
        states[run.slot] = state
        core[rows] = out.transpose(0, 1)
        if kept_windows is not None:
            plan.save(self.layer_idx, self.state_spec, run, (kept_windows, torch.stack(kept)))
