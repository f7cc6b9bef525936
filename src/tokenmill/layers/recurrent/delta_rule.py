"""The gated delta rule (Gated DeltaNet), a PyTorch reference: chunked scan and one step.

Per head, with a state S [K, V] and per token a decay g <= 0 (log space), a rate beta and
q, k [K], v [V] (q, k L2-normalized, q scaled by K ** -0.5 before the call):

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

Everything is float32. ``chunked`` runs a sequence C tokens at a time: inside a chunk the
updates are folded into a triangular solve (the WY / UT form), so a chunk costs a few
matmuls and the Python loop runs over chunks, not tokens.
"""

from __future__ import annotations

import torch

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (as the FLA kernels do)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, H, K], v [B, H, V], g, beta [B, H], state
    [B, H, K, V] -> (o [B, H, V], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)  # S^T k [B, H, V]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [H, L, K], v [H, L, V], g, beta [H, L], state [H, K, V] ->
    (o [H, L, V], the state after the L tokens)."""
    out, state, _ = chunked_keeping(q, k, v, g, beta, state, chunk=chunk)
    return out, state


def chunked_keeping(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lead: int = 0,
    keep: tuple[int, ...] = (),
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``chunked``, the chunks starting ``lead`` tokens before the first (padding), and
    the states after the first o tokens for each o of ``keep`` -> (o, state, kept). An o
    with ``lead + o`` a multiple of ``chunk`` is one of the scan's own chunk ends (no
    extra work: snapshots); any other o costs one [K, t] x [t, V] product per head from
    its chunk's start state (``partial_state``: a verify step's per-position states)."""
    heads, length, _ = k.shape
    pad = -(lead + length) % chunk  # padded tokens: k = 0, beta = 0, g = 0 change nothing
    if pad or lead:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, lead, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (lead, pad)) for x in (g, beta))
    n = (lead + length + pad) // chunk
    q, k, v = (x.reshape(heads, n, chunk, -1) for x in (q, k, v))
    cum = g.reshape(heads, n, chunk).cumsum(-1)  # [H, N, C] log decay since the chunk start
    beta = beta.reshape(heads, n, chunk, 1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta
    # (I + strictly-lower(beta k k^T decay)) [u | w] = [beta v | beta k exp(cum)]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta, k_beta * cum.exp()[..., None]], dim=-1)
    solved = _unit_lower_inverse(system) @ rhs
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C] within-chunk q.k, decayed
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from each token to chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(u)
    ends = keep_points(lead, keep, chunk)
    kept: list[torch.Tensor] = [state] * len(keep)
    for c in range(n):
        new_v = u[:, c] - w[:, c] @ state  # the part of v the state does not predict yet
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ new_v
        start = state
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ new_v
        for j, t in ends.get(c, ()):
            kept[j] = state if t == chunk else partial_state(start, cum[:, c], k[:, c], new_v, t)
    return out.reshape(heads, n * chunk, -1)[:, lead : lead + length], state, kept


def keep_points(lead: int, keep: tuple[int, ...], chunk: int) -> dict[int, list[tuple[int, int]]]:
    """Chunk index -> [(j, t)]: keep[j] is reached t tokens (1..chunk) into that chunk of a
    scan whose chunks start ``lead`` tokens before the sequence (o = 0: the start state,
    left out)."""
    ends: dict[int, list[tuple[int, int]]] = {}
    for j, o in enumerate(keep):
        if o > 0:
            c, t = divmod(lead + o - 1, chunk)
            ends.setdefault(c, []).append((j, t + 1))
    return ends


def partial_state(
    start: torch.Tensor, cum: torch.Tensor, k: torch.Tensor, new_v: torch.Tensor, t: int
) -> torch.Tensor:
    """The state after the first t tokens of a chunk: start [H, K, V] decayed to token
    t - 1, plus each token's correction decayed from it (the chunk-end update cut at t).
    cum [H, C] log decay since the chunk start, k [H, C, K], new_v [H, C, V]."""
    last = cum[:, t - 1 : t]  # [H, 1]
    k_to_t = k[:, :t] * (last - cum[:, :t]).exp()[..., None]  # [H, t, K]
    return start * last.exp()[..., None] + k_to_t.transpose(-1, -2) @ new_v[:, :t]


def _unit_lower_inverse(system: torch.Tensor) -> torch.Tensor:
    """(I + strictly-lower(system))^-1 for [..., C, C]: with A the strictly lower part,
    A^C = 0, so the inverse is (I - A)(I + A^2)(I + A^4)... (log2 C matmul pairs, about
    10x faster on CPU than a triangular solve with a wide right-hand side, as accurate)."""
    chunk = system.shape[-1]
    power = -system.tril(-1)
    inverse = torch.eye(chunk, dtype=system.dtype, device=system.device) + power
    covered = 2  # inverse holds the powers below `covered`
    while covered < chunk:
        power = power @ power
        inverse = inverse + inverse @ power
        covered *= 2
    return inverse
