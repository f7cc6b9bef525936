"""Bitmask unpacking and application in plain torch, against a per-token reference."""

from __future__ import annotations

import torch

from tokenmill.structured_output.bitmask import allocate_bitmask, apply_bitmask, unpack_bitmask


def _reference(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    words = bitmask.tolist()
    return torch.tensor(
        [
            [
                (row[t // 32] >> (t % 32)) & 1 == 1 if t // 32 < len(row) else False
                for t in range(vocab)
            ]
            for row in words
        ]
    )


def test_unpack_matches_the_bit_layout():
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    for vocab in (100, 128, 140):  # shorter than, equal to, longer than the mask
        assert torch.equal(unpack_bitmask(bitmask, vocab), _reference(bitmask, vocab))


def test_apply_masks_only_the_listed_rows():
    logits = torch.randn(3, 70)
    original = logits.clone()
    bitmask = allocate_bitmask(1, 3)
    bitmask[0] = 0
    bitmask[0, 1] = 1 << 5  # only token 37
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    assert logits[1].argmax().item() == 37
    assert torch.isinf(logits[1]).sum().item() == 69


def test_apply_to_every_row_and_the_sign_bit():
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = -(2**31)  # bit 31: token 31
    bitmask[1, 1] = -1  # tokens 32..63
    apply_bitmask(logits, bitmask, None)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(32, 64))
