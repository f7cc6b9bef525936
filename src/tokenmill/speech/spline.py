"""The inverse of a monotonic rational-quadratic spline with linear tails (Durkan et al.,
Neural Spline Flows), as VITS' duration flows use it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MIN_BIN = 1e-3
MIN_DERIVATIVE = 1e-3


def _knots(unnormalized: torch.Tensor, bound: float) -> torch.Tensor:
    """[..., K] -> [..., K + 1] knot positions from -bound to bound."""
    k = unnormalized.shape[-1]
    sizes = MIN_BIN + (1 - MIN_BIN * k) * unnormalized.softmax(-1)
    knots = F.pad(sizes.cumsum(-1), (1, 0)) * 2 * bound - bound
    knots[..., 0], knots[..., -1] = -bound, bound
    return knots


def inverse_rq_spline(
    y: torch.Tensor, widths: torch.Tensor, heights: torch.Tensor, derivs: torch.Tensor, bound: float
) -> torch.Tensor:
    """y [...]; widths, heights [..., K]; derivs [..., K - 1] (inner knots) -> x [...]

    Outside [-bound, bound] the map is the identity (linear tails, slope 1 at the ends).
    """
    end = math.log(math.exp(1 - MIN_DERIVATIVE) - 1)  # softplus^-1 of slope 1 - min
    derivs = F.pad(derivs, (1, 1), value=end)
    inside = (y >= -bound) & (y <= bound)
    xs, ys = _knots(widths, bound), _knots(heights, bound)
    d = MIN_DERIVATIVE + F.softplus(derivs)
    edges = ys.clone()
    edges[..., -1] += 1e-6
    idx = ((y[..., None] >= edges).sum(-1) - 1).clamp(0, widths.shape[-1] - 1)[..., None]

    def at(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx)[..., 0]

    x0, y0 = at(xs), at(ys)
    w, h = at(xs[..., 1:] - xs[..., :-1]), at(ys[..., 1:] - ys[..., :-1])
    delta = h / w
    d0, d1 = at(d), at(d[..., 1:])
    dy = y - y0
    a = dy * (d0 + d1 - 2 * delta) + h * (delta - d0)
    b = h * d0 - dy * (d0 + d1 - 2 * delta)
    c = -delta * dy
    root = (2 * c) / (-b - torch.sqrt((b * b - 4 * a * c).clamp_min(0)))
    return torch.where(inside, root * w + x0, y)
