"""The CPU argmax must be torch.argmax exactly: first index of the max, NaN wins; both the
native kernel (kernels/argmax.c, each ISA level) and the blocked tensor-op fallback."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sampling.argmax import BLOCK, argmax_rows

pytestmark = pytest.mark.usefixtures("native_isa")  # each native level and the fallback


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


def test_nan_and_signed_zero_in_the_tail_and_many_rows():
    """Vocabularies off the 16-lane vector width put ties and NaNs in the scalar tail."""
    vocab = 4 * BLOCK + 13  # 16 x 256 + 13: a 13-value tail
    x = torch.full((5, vocab), -2.0)
    x[0, vocab - 1] = float("nan")  # the only NaN, in the tail
    x[0, 7] = float("inf")
    x[1, [20, vocab - 2]] = float("nan")  # the first NaN wins, whatever follows
    x[2, 9] = -0.0  # -0.0 == 0.0: the first of the tie
    x[2, 30] = 0.0
    x[3, vocab - 5] = float("inf")
    x[4, :] = float("-inf")
    x[4, vocab - 1] = -1e30  # the max is the tail's last value
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [vocab - 1, 20, 9, vocab - 5, vocab - 1]
    assert torch.equal(argmax_rows(x), expected)
    many = torch.randn(300, 5 * BLOCK, generator=torch.Generator().manual_seed(3))
    assert torch.equal(argmax_rows(many), many.argmax(dim=-1))  # the parallel rows
