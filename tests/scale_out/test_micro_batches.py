"""A pipeline step cut into micro-batches (``distributed/micro_batches.py``): run piece by
piece, writing each piece's keys before attending, the attention gives the whole step's
output, also where a cut falls inside a prompt; steps that carry more than flat rows stay
whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.reference import attend, write_kv
from tokenmill.distributed.messages import Forward
from tokenmill.distributed.micro_batches import split_step

BS, HEADS, KV_HEADS, DIM = 4, 4, 2, 8
# (new tokens, context after the step, block table): a decode, a fresh 30-token prompt,
# a 12-token chunk after a cached 5-token prefix, another decode
SEQS = [(1, 10, [7, 8, 9]), (30, 30, [0, 1, 2, 3, 4, 5, 6, 10]), (12, 17, [11, 13, 12, 14, 15]),
        (1, 3, [16])]  # fmt: skip


def _step(seqs=SEQS) -> Forward:
    q_lens, s_lens, tables = zip(*seqs)
    meta = AttentionMetadata.build(list(q_lens), list(s_lens), list(tables), BS)
    tokens = sum(q_lens)
    positions = torch.cat([torch.arange(s - q, s) for q, s, _ in seqs])
    return Forward(torch.arange(tokens), positions, meta, torch.arange(tokens) % 3)


def _attention(step: Forward, pieces: list[Forward], window: int | None) -> tuple:
    g = torch.Generator().manual_seed(0)
    tokens = step.input_ids.shape[0]
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    kv = torch.randn(tokens, 2, KV_HEADS, DIM, generator=g)
    prefix = torch.randn(2, 20, BS, KV_HEADS, DIM, generator=g)  # cached contexts
    whole_cache = prefix.clone()
    write_kv(whole_cache, kv, step.attn.slot_mapping)
    whole = attend(q, kv, whole_cache, step.attn, DIM**-0.5, window)
    cache, outs, row = prefix.clone(), [], 0
    for piece in pieces:
        rows = slice(row, row + piece.input_ids.shape[0])
        write_kv(cache, kv[rows], piece.attn.slot_mapping)
        outs.append(attend(q[rows], kv[rows], cache, piece.attn, DIM**-0.5, window))
        row = rows.stop
    return whole, torch.cat(outs)


@pytest.mark.parametrize("pieces", [2, 3, 5])
@pytest.mark.parametrize("window", [None, 6])
def test_pieces_attend_as_the_whole_step(pieces, window):
    step = _step()
    cut = split_step(step, pieces, min_rows=4)
    assert len(cut) == pieces
    assert torch.equal(torch.cat([p.input_ids for p in cut]), step.input_ids)
    assert torch.equal(torch.cat([p.positions for p in cut]), step.positions)
    assert torch.equal(torch.cat([p.adapter_ids for p in cut]), step.adapter_ids)
    assert torch.equal(torch.cat([p.attn.slot_mapping for p in cut]), step.attn.slot_mapping)
    whole, pieced = _attention(step, cut, window)
    torch.testing.assert_close(pieced, whole, rtol=1e-5, atol=1e-5)


def test_a_cut_inside_a_prompt_shortens_its_first_context():
    # 44 rows: the cut at row 22 is in the prompt
    first, second = split_step(_step(), 2, min_rows=4)
    assert first.attn.query_start_loc == (0, 1, 22) and first.attn.seq_lens == (10, 21)
    assert second.attn.query_start_loc == (0, 9, 21, 22) and second.attn.seq_lens == (30, 17, 3)
    assert second.attn.block_tables.shape[0] == 3


def test_small_and_special_steps_stay_whole():
    decode = _step([(1, 5, [0, 1]), (1, 9, [2, 3, 4]), (1, 2, [5]), (1, 7, [6, 7])])
    assert split_step(decode, 2) == [decode]  # 4 rows: under MIN_PIECE_TOKENS per piece
    whole = _step()
    assert split_step(whole, 2) == [whole]  # 44 rows: two pieces would be too small
    step = _step()
    tree = dataclasses.replace(
        step, attn=dataclasses.replace(step.attn, extra_slots=torch.zeros(4, 1, dtype=torch.int64))
    )
    assert split_step(tree, 2, min_rows=4) == [tree]
    mrope = dataclasses.replace(step, positions=step.positions.expand(3, -1))
    assert split_step(mrope, 2, min_rows=4) == [mrope]
    assert split_step(step, 1) == [step]
