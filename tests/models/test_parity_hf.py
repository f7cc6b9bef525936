"""Every supported family matches Hugging Face `transformers` on tiny random-weight models.

Float32 throughout. Prefill, token-by-token greedy decoding through the paged
KV cache (block size 4, scattered block ids), and flattened batches that mix
prefill, chunked prefill and decode must all agree with HF run on each
sequence alone. Mistral and Gemma3 use a sliding window of 8, shorter than the
sequences, so the window is exercised.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import FAMILIES, build_hf, hf_logits, prompt
from paged_runner import PagedRunner, build_ours

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def models(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf = build_hf(request.param)
    return hf, build_ours(hf)


def test_prefill_logits_match(models) -> None:
    hf, ours = models
    ids = prompt(33, seed=1)
    logits = PagedRunner(ours).step([("a", ids)])[0]
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=RTOL)


def test_greedy_decode_matches_generate(models) -> None:
    hf, ours = models
    ids = prompt(24, seed=2)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=32, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert len(expected) == 32 and len(set(expected)) > 4, "degenerate reference continuation"
    assert PagedRunner(ours).greedy("a", ids, 32) == expected


def test_flattened_batch_matches_each_alone(models) -> None:
    hf, ours = models
    a, b, c = prompt(10, seed=3), prompt(21, seed=4), prompt(11, seed=5)
    ref_a, ref_b, ref_c = hf_logits(hf, a), hf_logits(hf, b), hf_logits(hf, c)
    runner = PagedRunner(ours)

    def check(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)

    # Two prefills, b only its first chunk.
    check(runner.step([("a", a[:7]), ("b", b[:13])]), [ref_a[:7], ref_b[:13]])
    # Mixed: a decodes, b prefills its next chunk over cached context, c prefills from scratch.
    check(
        runner.step([("a", a[7:8]), ("b", b[13:19]), ("c", c[:9])]),
        [ref_a[7:8], ref_b[13:19], ref_c[:9]],
    )
    # Pure decode for all three (the batched decode path), twice.
    for pa, pb, pc in ((8, 19, 9), (9, 20, 10)):
        got = runner.step([("a", a[pa : pa + 1]), ("b", b[pb : pb + 1]), ("c", c[pc : pc + 1])])
        check(got, [ref_a[pa : pa + 1], ref_b[pb : pb + 1], ref_c[pc : pc + 1]])
