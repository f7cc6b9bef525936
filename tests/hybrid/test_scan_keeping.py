"""States kept from inside a scan (``chunked_keeping``, what snapshots are taken from):
the scans aligned to absolute positions by ``lead`` give the same outputs, and the state
kept after o tokens equals the state of a scan over those o tokens alone; the conv
windows likewise (``CausalConv1d.windows_at``)."""

from __future__ import annotations

import torch

from tokenmill.layers.recurrent import delta_rule, ssd
from tokenmill.layers.recurrent.conv import CausalConv1d

H, K, V, P, N = 3, 8, 5, 4, 6


def _delta_inputs(length: int, gen: torch.Generator):
    q = delta_rule.l2_normalize(torch.randn(H, length, K, generator=gen)) * K**-0.5
    k = delta_rule.l2_normalize(torch.randn(H, length, K, generator=gen))
    v = torch.randn(H, length, V, generator=gen)
    g = -torch.rand(H, length, generator=gen) * 0.1  # slow decay: old tokens still count
    beta = torch.rand(H, length, generator=gen)
    return q, k, v, g, beta, torch.randn(H, K, V, generator=gen)


def test_delta_rule_keeps_the_states_at_its_chunk_ends():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta, state = _delta_inputs(100, gen)
    # the run starts at position 40: lead 40 % 16 = 8; keep after 24 and 88 tokens (64, 128)
    out, end, kept = delta_rule.chunked_keeping(q, k, v, g, beta, state, 8, (24, 88), chunk=16)
    want_out, want_end = delta_rule.chunked(q, k, v, g, beta, state, chunk=16)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, want_end, atol=1e-5, rtol=1e-5)
    for o, s in zip((24, 88), kept):
        cut = (x[:, :o] for x in (q, k, v, g, beta))
        torch.testing.assert_close(s, delta_rule.chunked(*cut, state, chunk=16)[1], atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
    assert not torch.allclose(kept[0], kept[1])


def test_ssd_keeps_the_states_at_its_chunk_ends():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(H, 50, P, generator=gen)
    dt = torch.rand(H, 50, generator=gen) * 0.1
    a, d = -torch.rand(H, generator=gen), torch.randn(H, generator=gen)
    b, c = torch.randn(H, 50, N, generator=gen), torch.randn(H, 50, N, generator=gen)
    state = torch.randn(H, P, N, generator=gen)
    y, end, kept = ssd.chunked_keeping(x, dt, a, b, c, d, state, 3, (13, 29), chunk=8)
    want_y, want_end = ssd.chunked(x, dt, a, b, c, d, state, chunk=8)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, want_end, atol=1e-5, rtol=1e-5)
    for o, s in zip((13, 29), kept):
        want = ssd.chunked(x[:, :o], dt[:, :o], a, b[:, :o], c[:, :o], d, state, chunk=8)[1]
        torch.testing.assert_close(s, want, atol=1e-5, rtol=1e-5)


def test_conv_windows_at_offsets():
    gen = torch.Generator().manual_seed(2)
    conv = CausalConv1d(6, 4, True, torch.float32)
    x, window = torch.randn(20, 6, generator=gen), torch.randn(6, 3, generator=gen)
    kept = conv.windows_at(x, window, (1, 7, 20))
    for o, w in zip((1, 7, 20), kept):
        torch.testing.assert_close(w, conv.forward_seq(x[:o], window)[1])
    fresh = conv.windows_at(x, None, (2,))[0]
    torch.testing.assert_close(fresh, conv.forward_seq(x[:2], None)[1])


def test_states_kept_inside_a_chunk_equal_the_recurrence():
    """A verify step keeps the state after every position (``worker/state_rollback.py``):
    offsets anywhere in a chunk, with and without ``lead``, equal token-by-token steps."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, g, beta, state = _delta_inputs(37, gen)
    x, dt = torch.randn(H, 37, P, generator=gen), torch.rand(H, 37, generator=gen) * 0.1
    a, d = -torch.rand(H, generator=gen), torch.randn(H, generator=gen)
    b, c = torch.randn(H, 37, N, generator=gen), torch.randn(H, 37, N, generator=gen)
    ssm_state = torch.randn(H, P, N, generator=gen)
    offsets = (0, 1, 5, 16, 20, 33, 36, 37)
    for lead, chunk in ((0, 16), (5, 16), (0, 37), (3, 8), (0, 4)):
        *_, kept = delta_rule.chunked_keeping(q, k, v, g, beta, state, lead, offsets, chunk)
        *_, kept_ssm = ssd.chunked_keeping(x, dt, a, b, c, d, ssm_state, lead, offsets, chunk)
        s, s_ssm = state[None], ssm_state[None]
        for t in range(38):
            if t in offsets:
                j = offsets.index(t)
                torch.testing.assert_close(kept[j], s[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(kept_ssm[j], s_ssm[0], atol=1e-5, rtol=1e-5)
            if t < 37:
                row = (y[:, t][None] for y in (q, k, v, g, beta))
                s = delta_rule.step(*row, s)[1]
                s_ssm = ssd.step(x[:, t][None], dt[:, t][None], a, b[:, t][None],
                                 c[:, t][None], d, s_ssm)[1]  # fmt: skip
