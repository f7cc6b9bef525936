"""The decoder's batched output projection and the timestamp rules' slice form."""

from __future__ import annotations

import pytest
import torch

from tokenmill.speech.rules import timestamp_bans, timestamp_mask
from tokenmill.speech.whisper import FEW_ROWS, linear, vocab_logits


@pytest.mark.parametrize("vocab", [51864, 51865, 7])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_vocab_logits_equal_a_plain_matmul(vocab, rows):
    g = torch.Generator().manual_seed(vocab + rows)
    w = torch.randn(vocab, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    out = vocab_logits(x, w)
    assert out.shape == (rows, vocab) and out.is_contiguous()
    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (1, 7), (FEW_ROWS, 1), (3, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_few_row_linear_equals_the_layer(shape, bias):
    torch.manual_seed(len(shape) + shape[0] + bias)
    layer = torch.nn.Linear(384, 1536, bias=bias)
    x = torch.randn(*shape, 384)
    with torch.inference_mode():
        out = linear(layer, x)
        assert out.shape == (*shape, 1536)
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)


def test_timestamp_bans_as_mask():
    ts, eot, vocab = 100, 90, 160
    cases = {
        (): (list(range(ts)) + list(range(ts + 51, vocab))),
        (ts + 3, 5): list(range(ts, ts + 4)),  # text after an opening stamp: no earlier stamp
        (ts + 3, 5, ts + 7): list(range(eot)) + list(range(ts, ts + 7)),  # close the pair
        (ts + 3, 5, ts + 7, ts + 7): list(range(ts, vocab)),  # a pair just closed: text next
    }
    for generated, want in cases.items():
        mask = timestamp_mask(list(generated), ts, eot, vocab)
        assert sorted(mask.nonzero()[:, 0].tolist()) == sorted(set(want)), generated
        assert timestamp_bans(list(generated), ts, eot)
