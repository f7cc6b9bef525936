"""The runner's packed inputs equal what ``AttentionMetadata.build`` makes from lists."""

from __future__ import annotations

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ScheduledSeq
from tokenmill.worker.inputs import HostIds, PinnedStaging, build_step_inputs

BS = 4


def seq(tokens: list[int], start: int, new: int, table: tuple[int, ...]) -> ScheduledSeq:
    req = Request("r", tokens, SamplingParams(max_tokens=4), 4, frozenset())
    return ScheduledSeq(req, start, new, table, samples=True)


def test_packed_inputs_match_metadata_build():
    seqs = (
        seq(list(range(10, 19)), 0, 9, (7, 8, 9)),  # a prefill over 3 consecutive blocks
        seq(list(range(30, 36)), 5, 1, (3, 1)),  # a decode in a scattered table
        seq(list(range(50, 57)), 4, 3, (2, 3)),  # a chunk after a cached prefix
    )
    inputs = build_step_inputs(seqs, BS, PinnedStaging(torch.device("cpu")))
    ref = AttentionMetadata.build(
        query_lens=[9, 1, 3],
        seq_lens=[9, 6, 7],
        block_tables=[[7, 8, 9], [3, 1], [2, 3]],
        block_size=BS,
    )
    assert inputs.input_ids.tolist() == list(range(10, 19)) + [35] + [54, 55, 56]
    assert inputs.positions.tolist() == list(range(9)) + [5] + [4, 5, 6]
    meta = inputs.meta
    assert torch.equal(meta.slot_mapping, ref.slot_mapping)
    assert meta.slot_mapping.tolist()[9:] == [1 * BS + 1, 3 * BS + 0, 3 * BS + 1, 3 * BS + 2]
    assert torch.equal(meta.block_tables, ref.block_tables)
    assert meta.block_tables.tolist() == [[7, 8, 9], [3, 1, 0], [2, 3, 0]]
    assert torch.equal(meta.seq_lens_tensor, ref.seq_lens_tensor)
    assert meta.query_start_loc == ref.query_start_loc == (0, 9, 10, 13)
    assert meta.seq_lens == ref.seq_lens
    assert meta.first_block_if_contiguous == ref.first_block_if_contiguous == (7, None, 2)
    for name in ("query_start_loc_tensor",):
        if hasattr(ref, name):  # present once the attention backends add it
            assert torch.equal(getattr(meta, name), getattr(ref, name))
            assert getattr(meta, name).dtype == getattr(ref, name).dtype


def test_cpu_staging_builds_fresh_tensors():
    staging = PinnedStaging(torch.device("cpu"))
    first = staging.upload([1, 2, 3])
    staging.upload([4, 5, 6])
    assert first.tolist() == [1, 2, 3]  # not a view of a reused buffer
    out = torch.zeros(2, dtype=torch.int64)
    assert staging.upload([7, 8], out=out) is out and out.tolist() == [7, 8]


def test_host_ids_on_cpu():
    assert HostIds(torch.device("cpu")).fetch(torch.tensor([3, 1, 2])) == [3, 1, 2]
