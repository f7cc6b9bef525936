"""Bidirectional media spans: the reference attention's mask against a dense one written
out here (HF's AND(window, OR(causal, span))), for a whole prompt and for a chunk that
starts inside a span whose first tokens are cached; the scheduler's whole-run rule."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.reference import paged_attention
from tokenmill.multimodal.encoder_budget import EncoderBudget
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.scheduler.request import Request

H, KVH, D, BS = 4, 2, 8, 4


def _dense(q, k, v, q_pos, spans, window):
    """Every (query, key) pair scored, then masked: [Q, H, D]."""
    k_pos = torch.arange(k.shape[0])
    allowed = k_pos[None] <= q_pos[:, None]
    for a, b in spans:
        inq, ink = (q_pos >= a) & (q_pos < b), (k_pos >= a) & (k_pos < b)
        allowed |= inq[:, None] & ink[None]
    if window is not None:
        allowed &= k_pos[None] > q_pos[:, None] - window
    kk, vv = (x.repeat_interleave(H // KVH, dim=1).transpose(0, 1) for x in (k, v))
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) * D**-0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ vv).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cached", [0, 9])  # 9: the chunk starts inside the span [6, 14)
def test_spans_widen_the_causal_mask_exactly(window, cached):
    gen = torch.Generator().manual_seed(0)
    length, spans = 20, ((6, 14), (16, 19))
    q_all = torch.randn(length, H, D, generator=gen)
    kv_all = torch.randn(length, 2, KVH, D, generator=gen)
    cache = torch.zeros(2, 16, BS, KVH, D)
    table = list(range(3, 3 + -(-length // BS)))
    if cached:  # the cached prefix's keys are already stored
        pre = AttentionMetadata.build([cached], [cached], [table], BS)
        paged_attention(q_all[:cached], kv_all[:cached], cache, pre, D**-0.5, window)
    meta = AttentionMetadata.build([length - cached], [length], [table], BS)
    live = tuple((a, b) for a, b in spans if b > cached)
    meta = AttentionMetadata(**{**meta.__dict__, "bidirectional_spans": (live,)})
    out = paged_attention(q_all[cached:], kv_all[cached:], cache, meta, D**-0.5, window)
    ref = _dense(q_all[cached:], kv_all[:, 0], kv_all[:, 1], torch.arange(cached, length), spans,
                 window)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    causal = paged_attention(
        q_all[cached:],
        kv_all[cached:],
        cache,
        AttentionMetadata.build([length - cached], [length], [table], BS),
        D**-0.5,
        window,
    )
    assert not torch.allclose(causal, ref, atol=1e-3)  # the spans change the result


def _request(runs: list[tuple[int, int]], computed: int = 0) -> Request:
    items = tuple(MediaItem("image", bytes([i]), None, (1, 1, n), n)  # type: ignore[arg-type]
                  for i, (_, n) in enumerate(runs))  # fmt: skip
    req = Request("r", [0] * 100, SamplingParams(), 10, frozenset())
    req.mm_inputs = MultiModalInputs(items, tuple(PlaceholderRange(o, n) for o, n in runs),
                                     bidirectional=True)  # fmt: skip
    req.num_computed_tokens = computed
    return req


def test_a_chunk_never_ends_inside_a_bidirectional_run():
    budget = EncoderBudget(1000)
    budget.reset()
    assert budget.cap(_request([(10, 30)]), 20) == 10  # ends before the run
    assert budget.cap(_request([(10, 30)]), 40) == 40  # holds the whole run
    assert budget.cap(_request([(0, 30)]), 20) == 0  # starts at the run, can not finish it
    assert budget.cap(_request([(0, 30)], computed=12), 18) == 18  # a cached start: to its end
    assert budget.cap(_request([(0, 30)], computed=12), 10) == 0
