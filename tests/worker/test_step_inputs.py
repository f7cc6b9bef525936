"""The runner's packed inputs equal what ``AttentionMetadata.build`` makes from lists."""

from __future__ import annotations

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ScheduledSeq
from tokenmill.scheduler.request import Request
from tokenmill.worker.inputs import HostIds, PinnedStaging, build_step_inputs

BS = 4
CPU = torch.device("cpu")


def seq(
    tokens: list[int], start: int, new: int, table: tuple[int, ...], row: int = -1
) -> ScheduledSeq:
    req = Request("r", tokens, SamplingParams(max_tokens=4), 4, frozenset())
    return ScheduledSeq(req, start, new, table, samples=True, table_row=row)


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
    # 13 tokens, 3 sequences: odd section sizes, yet every view starts 16-byte aligned (as
    # the packed vector's start is), so Triton builds one variant, not one per parity.
    base = inputs.input_ids.data_ptr()
    views = (inputs.positions, meta.slot_mapping, meta.seq_lens_tensor,
             meta.query_start_loc_tensor, meta.block_tables)  # fmt: skip
    assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    for name in ("query_start_loc_tensor",):
        if hasattr(ref, name):  # present once the attention backends add it
            assert torch.equal(getattr(meta, name), getattr(ref, name))
            assert getattr(meta, name).dtype == getattr(ref, name).dtype


def test_inputs_from_the_table_array_equal_inputs_from_lists():
    """The scheduler's path (rows of the KV manager's array, other rows in between)
    builds the same step as the per-sequence lists."""
    lists = ((7, 8, 9), (3, 1), (2, 3))
    tables = BlockTableArray(width=2)
    rows = [tables.acquire() for _ in range(5)][1::2] + [tables.acquire()]  # rows 1, 3, 5
    tables.write(0, 0, [40, 41, 42, 43])  # a row no sequence of this step uses
    for row, table in zip(rows, lists):
        tables.write(row, 0, table)
    specs = ((list(range(10, 19)), 0, 9), (list(range(30, 36)), 5, 1), (list(range(50, 57)), 4, 3))
    by_list = build_step_inputs(
        tuple(seq(t, a, n, tab) for (t, a, n), tab in zip(specs, lists)), BS, PinnedStaging(CPU)
    )
    by_row = build_step_inputs(
        tuple(seq(t, a, n, tab, row) for (t, a, n), tab, row in zip(specs, lists, rows)),
        BS, PinnedStaging(CPU), tables,
    )  # fmt: skip
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(by_row, name), getattr(by_list, name))
    for name in ("slot_mapping", "block_tables", "seq_lens_tensor", "query_start_loc_tensor",
                 "query_start_loc", "seq_lens", "first_block_if_contiguous"):  # fmt: skip
        a, b = getattr(by_row.meta, name), getattr(by_list.meta, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name


def upload(staging: PinnedStaging, values: list[int], out: torch.Tensor | None = None):
    host = staging.host(len(values))
    host[:] = values
    return staging.send(host, out)


def test_cpu_staging_builds_fresh_tensors():
    staging = PinnedStaging(torch.device("cpu"))
    first = upload(staging, [1, 2, 3])
    upload(staging, [4, 5, 6])
    assert first.tolist() == [1, 2, 3]  # not a view of a reused buffer
    out = torch.zeros(2, dtype=torch.int64)
    assert upload(staging, [7, 8], out=out) is out and out.tolist() == [7, 8]


def test_host_ids_on_cpu():
    host_ids = HostIds(torch.device("cpu"))
    assert host_ids.copy(torch.tensor([3, 1, 2])).tolist() == [3, 1, 2]
