"""The recurrent layers' reference math: the chunked gated delta rule equals its one-token
recurrence, and scans (delta rule, causal conv) split anywhere carry their state exactly."""

from __future__ import annotations

import torch

from tokenmill.layers.recurrent import delta_rule
from tokenmill.layers.recurrent.conv import CausalConv1d

H, K, V = 3, 8, 5


def _inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = delta_rule.l2_normalize(torch.randn(H, length, K, generator=gen)) * K**-0.5
    k = delta_rule.l2_normalize(torch.randn(H, length, K, generator=gen))
    v = torch.randn(H, length, V, generator=gen)
    g = -torch.rand(H, length, generator=gen)  # log decay <= 0
    beta = torch.rand(H, length, generator=gen)
    state = torch.randn(H, K, V, generator=gen)
    return q, k, v, g, beta, state


def _token_by_token(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[1]):
        o, s = delta_rule.step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t],
                               beta[None, :, t], state[None])  # fmt: skip
        outs.append(o[0])
        state = s[0]
    return torch.stack(outs, 1), state


def test_chunked_equals_the_recurrence():
    for length, chunk in ((11, 4), (1, 64), (64, 64), (70, 16)):
        inputs = _inputs(length)
        out, state = delta_rule.chunked(*inputs, chunk=chunk)
        want_out, want_state = _token_by_token(*inputs)
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


def test_chunked_carries_state_across_calls():
    q, k, v, g, beta, state = _inputs(37, seed=1)
    whole, end = delta_rule.chunked(q, k, v, g, beta, state, chunk=8)
    first, mid = delta_rule.chunked(
        q[:, :13], k[:, :13], v[:, :13], g[:, :13], beta[:, :13], state, chunk=8
    )
    second, end2 = delta_rule.chunked(
        q[:, 13:], k[:, 13:], v[:, 13:], g[:, 13:], beta[:, 13:], mid, chunk=8
    )
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end2, end, atol=1e-5, rtol=1e-5)


def test_conv_window_carries_across_calls():
    torch.manual_seed(0)
    conv = CausalConv1d(6, 4, True, torch.float32)
    conv.weight.data.normal_()
    conv.bias.data.normal_()
    x = torch.randn(9, 6)
    whole, window = conv.forward_seq(x, None)
    head, w = conv.forward_seq(x[:2], None)  # shorter than the window
    outs = [head]
    for t in range(2, 9):
        y, w = conv.forward_step(x[t : t + 1], w[None])
        outs.append(y)
        w = w[0]
    torch.testing.assert_close(torch.cat(outs), whole)
    torch.testing.assert_close(w, window)


def test_ssd_chunked_equals_the_recurrence():
    from tokenmill.layers.recurrent import ssd

    gen = torch.Generator().manual_seed(2)
    h, p, n = 3, 4, 5
    for length, chunk in ((11, 4), (1, 64), (33, 16)):
        x = torch.randn(h, length, p, generator=gen)
        dt = torch.rand(h, length, generator=gen)
        a, d = -torch.rand(h, generator=gen) * 2, torch.randn(h, generator=gen)
        b, c = torch.randn(h, length, n, generator=gen), torch.randn(h, length, n, generator=gen)
        state = torch.randn(h, p, n, generator=gen)
        out, end = ssd.chunked(x, dt, a, b, c, d, state, chunk=chunk)
        s, outs = state[None], []
        for t in range(length):
            y, s = ssd.step(x[None, :, t], dt[None, :, t], a, b[None, :, t], c[None, :, t], d, s)
            outs.append(y[0])
        torch.testing.assert_close(out, torch.stack(outs, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(end, s[0], atol=1e-5, rtol=1e-5)
