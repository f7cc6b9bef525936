"""Mamba2's selective state-space scan (SSD), a PyTorch reference: chunked and one step.

Per head, with a state S [P, N] and per token a step dt > 0, the head's A < 0, x [P] and
B, C [N] (already expanded from their groups to the heads):

    S <- exp(dt A) S + dt x B^T;   y = S C + D x

Everything is float32. ``chunked`` runs a sequence C tokens at a time: inside a chunk the
outputs are one masked, decayed (C B^T) product; the loop runs over chunks.
"""

from __future__ import annotations

import torch

from tokenmill.layers.recurrent.delta_rule import keep_points

CHUNK = 64


def step(x, dt, a, b, c, d, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [B, H, P], dt [B, H], a, d [H], b, c [B, H, N], state
    [B, H, P, N] -> (y [B, H, P], the new state)."""
    state = state * (dt * a).exp()[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None]
    return (state * c[:, :, None]).sum(-1) + d[:, None] * x, state


def chunked(x, dt, a, b, c, d, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [H, L, P], dt [H, L], a, d [H], b, c [H, L, N], state [H, P, N] ->
    (y [H, L, P], the state after the L tokens)."""
    y, state, _ = chunked_keeping(x, dt, a, b, c, d, state, chunk=chunk)
    return y, state


def chunked_keeping(
    x, dt, a, b, c, d, state, lead: int = 0, keep: tuple[int, ...] = (), chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunked``, the chunks starting ``lead`` tokens before the first (padding), and
    the states after the first o tokens for each o of ``keep`` -> (y, state, kept): at a
    chunk end (``lead + o`` a multiple of ``chunk``) the scan's own state, elsewhere one
    [P, t] x [t, N] product per head from the chunk's start state (``partial_state``)."""
    heads, length, _ = x.shape
    pad = -(lead + length) % chunk  # padded tokens: dt = 0 changes nothing
    skip = d[:, None, None] * x
    if pad or lead:
        x, b, c = (torch.nn.functional.pad(t, (0, 0, lead, pad)) for t in (x, b, c))
        dt = torch.nn.functional.pad(dt, (lead, pad))
    n = (lead + length + pad) // chunk
    x, b, c = (t.reshape(heads, n, chunk, -1) for t in (x, b, c))
    dt = dt.reshape(heads, n, chunk)
    cum = (dt * a[:, None, None]).cumsum(-1)  # [H, N, C] log decay since the chunk start
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    x_dt = x * dt[..., None]
    within = ((c @ b.transpose(-1, -2)) * decay) @ x_dt  # [H, N, C, P]
    from_start = cum.exp()[..., None]  # decay from the chunk start to each token
    to_end = (cum[..., -1:] - cum).exp()[..., None]  # from each token to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(within)
    ends = keep_points(lead, keep, chunk)
    kept: list[torch.Tensor] = [state] * len(keep)
    for i in range(n):
        out[:, i] = within[:, i] + from_start[:, i] * (c[:, i] @ state.transpose(-1, -2))
        start = state
        state = state * chunk_decay[:, i] + (x_dt[:, i] * to_end[:, i]).transpose(-1, -2) @ b[:, i]
        for j, t in ends.get(i, ()):
            kept[j] = (
                state if t == chunk else partial_state(start, cum[:, i], x_dt[:, i], b[:, i], t)
            )
    return out.reshape(heads, n * chunk, -1)[:, lead : lead + length] + skip, state, kept


def partial_state(start, cum, x_dt, b, t: int) -> torch.Tensor:
    """The state after the first t tokens of a chunk: start [H, P, N] decayed to token
    t - 1, plus each token's dt x B^T decayed from it. cum [H, C] log decay since the
    chunk start, x_dt [H, C, P], b [H, C, N]."""
    last = cum[:, t - 1 : t]  # [H, 1]
    x_to_t = x_dt[:, :t] * (last - cum[:, :t]).exp()[..., None]  # [H, t, P]
    return start * last.exp()[..., None] + x_to_t.transpose(-1, -2) @ b[:, :t]
