"""Bidirectional media spans: the reference attention's mask against a dense one written
out here (HF's AND(window, OR(causal, span))), for a whole prompt and for a chunk that
starts inside a span whose first tokens are cached; the scheduler's whole-run rule; the
runner's step sets spans only for bidirectional runs in the chunk (a text-only step's
context comes back untouched)."""

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


def _request(runs: list[tuple[int, int]], computed: int = 0, bidirectional: bool = True) -> Request:
    items = tuple(MediaItem("image", bytes([i]), None, (1, 1, n), n)  # type: ignore[arg-type]
                  for i, (_, n) in enumerate(runs))  # fmt: skip
    req = Request("r", [0] * 100, SamplingParams(), 10, frozenset())
    req.mm_inputs = MultiModalInputs(items, tuple(PlaceholderRange(o, n) for o, n in runs),
                                     bidirectional=bidirectional)  # fmt: skip
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


class _Tower:
    """An encoder stub: item j's rows are all j + 1 (no real tower needed here)."""

    def __init__(self) -> None:
        from tokenmill.multimodal.model import MultiModalInfo

        self.multimodal = MultiModalInfo(image_token_id=7, video_token_id=-1, merge_size=1)
        self.calls = 0

    def encode(self, items):
        self.calls += 1
        return [torch.full((it.num_tokens, 4), float(it.content_hash[0] + 1)) for it in items]


def _seq(req: Request, start: int, n: int):
    from tokenmill.scheduler.output import ScheduledSeq

    return ScheduledSeq(req, start, n, [0], False)


def test_the_step_sets_spans_only_for_bidirectional_runs_in_the_chunk():
    from tokenmill.attention.context import StepContext
    from tokenmill.multimodal.step import MultiModalStep

    step = MultiModalStep(_Tower(), 1 << 20)  # type: ignore[arg-type]
    text = Request("t", [0] * 40, SamplingParams(), 10, frozenset())
    meta = AttentionMetadata.build([20], [20], [[0, 1, 2, 3, 4]], BS)
    ctx = StepContext(meta, [])
    positions = torch.arange(20)
    assert step.prepare([_seq(text, 0, 20)], ctx, positions)[1] is ctx  # text only: untouched
    req = _request([(4, 10), (20, 8)])
    meta = AttentionMetadata.build([20, 20], [20, 20], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], BS)
    _, out = step.prepare([_seq(text, 0, 20), _seq(req, 0, 20)], StepContext(meta, []), positions)
    assert out.attn.bidirectional_spans == ((), ((4, 14),))  # the second run is not in the chunk
    assert out.input_embeds is not None and out.input_embeds.rows.tolist() == list(range(24, 34))
    plain = _request([(4, 10)], bidirectional=False)
    _, out = step.prepare([_seq(plain, 0, 20)], StepContext(meta, []), positions)
    assert out.attn.bidirectional_spans is None and out.input_embeds is not None
