"""Mamba2's mixer: one input projection, causal conv over (x, B, C), the SSD scan, a
grouped gated RMSNorm, the output projection; conv window and SSM state in a slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.kv_cache.spec import RecurrentState
from tokenmill.layers.linear import Linear
from tokenmill.layers.recurrent import ssd
from tokenmill.layers.recurrent.conv import CausalConv1d
from tokenmill.layers.recurrent.plan import Run, StatePlan
from tokenmill.layers.recurrent.scan import REFERENCE_SCAN, ScanKernels


@dataclass(frozen=True)
class Mamba2Shape:
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    bias: bool
    eps: float
    dt_limit: tuple[float, float]
    out_bias: bool | None = None
    """Bias on out_proj; None: as ``bias`` (Falcon-H1 sets it apart)."""

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


class GroupedGatedRMSNorm(nn.Module):
    """A gated RMSNorm over each of ``groups`` equal slices: w * norm(y * silu(z)) with
    ``gate_first`` (Mamba2's ``MambaRMSNormGated``), else w * norm(y) * silu(z); the
    products in float32."""

    def __init__(self, dim: int, groups: int, eps: float, dtype: torch.dtype,
                 gate_first: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.groups, self.eps, self.gate_first = groups, eps, gate_first
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = F.silu(z.float())
        x = y.float() * gate if self.gate_first else y.float()
        grouped = x.view(*y.shape[:-1], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gate_first:
            return self.weight * grouped.view(y.shape).to(y.dtype)
        return (self.weight * grouped.view(y.shape) * gate).to(y.dtype)


class SiluGate(nn.Module):
    """y * silu(z), no norm (Falcon-H1 without ``mamba_rms_norm``)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(z.float())).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """hidden [T, hidden] -> [T, hidden]; reads and writes this layer's state slots."""

    def __init__(self, shape: Mamba2Shape, layer_idx: int, dtype: torch.dtype,
                 norm: nn.Module | None = None, scan: ScanKernels = REFERENCE_SCAN) -> None:  # fmt: skip
        """``layer_idx``: the layer's entry in ``ctx.kv_caches``. ``norm(y, z)``: the gate
        (default Mamba2's grouped gated RMSNorm, loaded as ``norm.weight``). ``scan``: the
        SSD kernels (``ops.scan``, chosen at load)."""
        super().__init__()
        self.shape, self.layer_idx, self.scan = shape, layer_idx, scan
        h = shape.num_heads
        self.in_proj = Linear(
            shape.hidden_size, shape.inner + shape.conv_dim + h, shape.bias, dtype
        )
        self.conv1d = CausalConv1d(shape.conv_dim, shape.conv_kernel, shape.conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
        self.norm = norm or GroupedGatedRMSNorm(shape.inner, shape.n_groups, shape.eps, dtype)
        out_bias = shape.bias if shape.out_bias is None else shape.out_bias
        self.out_proj = Linear(shape.inner, shape.hidden_size, out_bias, dtype)
        self.state_spec = RecurrentState.of(
            self.conv1d.state_shape, (h, shape.head_dim, shape.state_size), dtype=torch.float32
        )
        """The conv window [conv_dim, K - 1] and the SSM state [H, P, N], float32."""

    def forward(self, hidden: torch.Tensor, ctx: StepContext, plan: StatePlan) -> torch.Tensor:
        s, tokens = self.shape, hidden.shape[0]
        cache = ctx.kv_caches[self.layer_idx]
        assert cache is not None, f"layer {self.layer_idx} has no state slots"
        windows, states = self.state_spec.split(cache)
        z, xbc, dt = self.in_proj(hidden, ctx).split([s.inner, s.conv_dim, s.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*s.dt_limit)  # [T, H]
        y = torch.empty(tokens, s.num_heads, s.head_dim, device=hidden.device)
        if plan.num_singles:
            self._singles(xbc, dt, windows, states, plan, y)
        for run in plan.runs:
            self._run(xbc, dt, windows, states, run, y, plan)
        normed = self.norm(y.reshape(tokens, s.inner).to(hidden.dtype), z)
        return self.out_proj(normed, ctx)

    def _xbc(
        self, conv_out: torch.Tensor, expand: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [N, conv_dim] -> x [N, H, P], B, C [N, H, S] (groups expanded; [N, G, S]
        unless ``expand``), float32."""
        s, n = self.shape, conv_out.shape[0]
        x, b, c = (
            F.silu(conv_out)
            .float()
            .split([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        )
        b, c = b.reshape(n, s.n_groups, s.state_size), c.reshape(n, s.n_groups, s.state_size)
        group = s.num_heads // s.n_groups
        if group > 1 and expand:
            b, c = b.repeat_interleave(group, 1), c.repeat_interleave(group, 1)
        return x.reshape(n, s.num_heads, s.head_dim), b, c

    def _params(self) -> tuple[torch.Tensor, torch.Tensor]:
        return -self.A_log.float().exp(), self.D.float()

    def _singles(self, xbc, dt, windows, states, plan: StatePlan, y) -> None:
        keep = plan.keep
        window = windows.index_select(0, plan.slots) * keep[:, None, None]
        conv_out, window = self.conv1d.forward_step(plan.gather(xbc), window)
        windows.index_copy_(0, plan.slots, window.to(windows.dtype))
        x, b, c = self._xbc(conv_out, expand=False)
        a, d = self._params()
        out = self.scan.ssd_step(x, plan.gather(dt), a, b, c, d, states, plan.slots, keep)
        plan.scatter(y, out)

    def _run(self, xbc, dt, windows, states, run: Run, y, plan: StatePlan) -> None:
        rows = slice(run.start, run.end)
        window = None if run.fresh else windows[run.slot]
        kept_windows = None  # taken before the slot's window (which `window` views) changes
        if run.offsets:  # snapshots and a verify step's per-position states
            kept_windows = self.conv1d.windows_at(xbc[rows], window, run.offsets)
        conv_out, window = self.conv1d.forward_seq(xbc[rows], window)
        windows[run.slot] = window
        x, b, c = self._xbc(conv_out)
        state = torch.zeros_like(states[run.slot]) if run.fresh else states[run.slot]
        a, d = self._params()
        out, state, kept = self.scan.ssd_scan(
            x.transpose(0, 1), dt[rows].T, a, b.transpose(0, 1), c.transpose(0, 1), d, state,
            run.lead(ssd.CHUNK), run.offsets, run.chunk(ssd.CHUNK),
        )  # fmt: skip
        states[run.slot] = state
        y[rows] = out.transpose(0, 1)
        if kept_windows is not None:
            plan.save(self.layer_idx, self.state_spec, run, (kept_windows, torch.stack(kept)))
