"""The blocked CPU argmax must be torch.argmax exactly: first index of the max, NaN wins."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sampling.argmax import BLOCK, argmax_rows


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 151936), (33, 4 * BLOCK + 5), (2, 100)])
def test_random_rows_equal_torch(rows, vocab):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_masked_rows():
    vocab = 5 * BLOCK + 17
    x = torch.full((6, vocab), -1.0)
    x[0, [10, 3000, vocab - 1]] = 2.0  # ties: the first
    x[1, vocab - 3] = 9.0  # the max in the short last block
    x[2, 4000] = float("nan")  # NaN counts as the maximum
    x[2, 5] = 100.0
    x[3] = float("-inf")  # everything masked: index 0
    x[4, [BLOCK - 1, BLOCK]] = 3.0  # a tie across a block boundary
    x[5, 2 * BLOCK : 3 * BLOCK] = float("-inf")
    x[5, 2 * BLOCK + 7] = 0.5
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [10, vocab - 3, 4000, 0, BLOCK - 1, 2 * BLOCK + 7]
    assert torch.equal(argmax_rows(x), expected)
