"""A draft model's lm_head over part of the vocabulary (``draft_vocab_size``).

A 0.5B draft of a 151k-token family spends about a third of each step on its lm_head
(151936 x 896). Its drafts are only guesses, the target decides every token, so the draft
may score fewer ids: its first ``keep`` (BPE ids rank merges, the frequent tokens come
first) and its special tokens (end of turn, end of text). The other ids get -inf: never
proposed, while the output stays the target's own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill import native

logger = logging.getLogger(__name__)
TILE = native.TILE


class PartialHead(nn.Module):
    """Logits of the kept rows of ``head`` (two tile-aligned ranges: [0, keep) and the
    special tokens' tail from ``tail``); -inf elsewhere. [T, hidden] -> [T, vocab]."""

    def __init__(self, head: Any, keep: int, tail: int) -> None:
        super().__init__()
        self.vocab: int = head.out_features
        self.keep, self.tail = keep, tail
        bias = getattr(head, "bias", None)
        rows = torch.cat((torch.arange(keep), torch.arange(tail, self.vocab)))
        self.bias = None if bias is None else bias.detach()[rows].clone()
        self.bits = 0
        if hasattr(head, "qtiles"):  # affine groups: whole 16-row tiles, as packed
            tiles = head.qtiles
            self.bits = head.method.bits
            self.weight = torch.cat((tiles[: keep // TILE], tiles[tail // TILE :])).clone()
        else:
            self.weight = head.weight.detach()[rows].clone()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.bits:
            x = hidden if hidden.dtype in (torch.float32, torch.bfloat16) else hidden.float()
            rows = self.weight.shape[0] * TILE
            y = native.affine_gemm(x.contiguous(), self.weight, self.bits, rows)
        else:
            y = nn.functional.linear(hidden, self.weight)
        if self.bias is not None:
            y = y + self.bias
        out = y.new_full((y.shape[0], self.vocab), float("-inf"))
        out[:, : self.keep] = y[:, : self.keep]
        out[:, self.tail :] = y[:, self.keep :]
        return out


def trim_lm_head(model: Any, keep: int, special_ids: Iterable[int]) -> bool:
    """Give ``model`` a ``PartialHead`` scoring ids below ``keep`` (rounded up to a tile)
    and from the tile of its first special id past them on; False (model unchanged) when
    its head can not be cut so (tied embeddings, or no rows saved)."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "out_features"):
        logger.info("draft_vocab_size: the draft's lm_head is tied or missing, left whole")
        return False
    if not (hasattr(head, "qtiles") or isinstance(getattr(head, "weight", None), torch.Tensor)):
        logger.info("draft_vocab_size: the draft's lm_head format can not be cut, left whole")
        return False
    vocab: int = head.out_features
    keep = min(vocab, -(-keep // TILE) * TILE)
    past = [i for i in special_ids if keep <= i < vocab]
    tail = min(past) // TILE * TILE if past else vocab
    if keep + vocab - tail >= vocab:
        return False
    model.lm_head = PartialHead(head, keep, tail)
    logger.info(
        "speculative decoding: the draft scores %d of its %d token ids (0..%d and %d..%d)",
        keep + vocab - tail, vocab, keep - 1, tail, vocab - 1,
    )  # fmt: skip
    return True
