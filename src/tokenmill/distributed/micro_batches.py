"""A pipeline step cut into micro-batches, so that the stages overlap.

With the step whole, stage s + 1 waits while stage s runs every token. Cut into n pieces
of consecutive rows, stage s sends piece j on and starts piece j + 1 while stage s + 1 runs
piece j: with P stages the step takes about (n + P - 1) / n piece-times per stage instead
of P.

A cut may fall inside a sequence's rows (a long prefill): its first piece then ends its
context earlier (``seq_lens`` counts only the rows up to the cut) and its second piece
attends the first's keys from the cache, which the same stage wrote when it ran the
earlier piece. So each piece is an ordinary chunked-prefill step: the attention backends
run it unchanged, and the result is the whole step's.

Steps that carry more than flat token rows (draft-tree slots, bidirectional media spans,
merged input embeddings, multi-row M-RoPE positions, recurrent state slots) are not cut.
"""

from __future__ import annotations

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.distributed.messages import Forward

MIN_PIECE_TOKENS = 64
"""Fewer rows per piece than this and a piece's fixed cost (every layer's calls in Python,
a send and its wake-up) outweighs the overlap: cutting an 8-sequence decode step over 2
CPU stages made it slower (measured), so decode steps mostly stay whole and prefill
chunks are cut."""


def split_step(step: Forward, pieces: int, min_rows: int = MIN_PIECE_TOKENS) -> list[Forward]:
    """``step`` as up to ``pieces`` consecutive row ranges of at least ``min_rows`` rows
    each (the step itself when it can not or need not be cut)."""
    tokens = step.input_ids.shape[0]
    pieces = min(pieces, tokens // min_rows)
    if pieces <= 1 or not _cuttable(step):
        return [step]
    cuts = [tokens * j // pieces for j in range(pieces + 1)]
    return [_rows(step, a, b) for a, b in zip(cuts, cuts[1:])]


def _cuttable(step: Forward) -> bool:
    meta = step.attn
    return (
        meta.extra_slots is None
        and meta.bidirectional_spans is None
        and step.input_embeds is None
        and step.state is None  # a state slot's sequence is one scan: its rows stay whole
        and step.positions.dim() == 1
    )


def _rows(step: Forward, a: int, b: int) -> Forward:
    """Rows [a, b) of ``step``: the sequences with rows there, each up to its last row
    in the range."""
    meta = step.attn
    starts, ends = meta.query_start_loc[:-1], meta.query_start_loc[1:]
    seqs = [i for i, (lo, hi) in enumerate(zip(starts, ends)) if lo < b and hi > a]
    qsl, seq_lens = [0], []
    for i in seqs:
        lo, hi = max(starts[i], a), min(ends[i], b)
        qsl.append(qsl[-1] + hi - lo)
        seq_lens.append(meta.seq_lens[i] - (ends[i] - hi))  # the rows after the cut come later
    device = meta.slot_mapping.device
    index = torch.tensor(seqs, dtype=torch.int64, device=meta.block_tables.device)
    first = meta.first_block_if_contiguous  # a shorter context of contiguous blocks is too
    piece = AttentionMetadata(
        slot_mapping=meta.slot_mapping[a:b],
        query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens),
        block_tables=meta.block_tables.index_select(0, index),
        block_size=meta.block_size,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        first_block_if_contiguous=tuple(first[i] for i in seqs) if first else (),
        query_start_loc_tensor=torch.tensor(qsl, dtype=torch.int64, device=device),
    )
    adapters = step.adapter_ids[a:b] if step.adapter_ids is not None else None
    return Forward(step.input_ids[a:b], step.positions[a:b], piece, adapters)
