"""Split-KV decode of the Triton paged attention: forced splits against one program per
sequence and against the reference backend, and the automatic choice of the split count
(a power of two: each count is a compiled variant).

Contexts are a few hundred keys so that, with 64-key tiles, 3 splits leave uneven ranges
and 8 splits leave some ranges empty. On CPU the kernels run interpreted in float32; the
``gpu`` variants run compiled in bfloat16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _attn_cases import Case, make_case, reference, with_padding

triton = pytest.importorskip("triton")

from tokenmill.attention import triton_kernels  # noqa: E402
from tokenmill.attention.triton_kernels import MAX_SPLITS, decode_num_splits  # noqa: E402

SPLITS = (2, 3, 8)
SEQ_LENS = [1, 67, 201, 130]  # one key, odd lengths, under one / two / four 64-key tiles


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _tol(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 2e-2


def _decode(case: Case, num_splits, window=None, softcap=None, meta=None, q=None, kv=None):
    """Store the new K/V into a copy of the cache, then decode attention -> out [B, H, D]."""
    meta = meta or case.meta
    q = case.q if q is None else q
    cache = case.cache.clone()
    triton_kernels.store_kv(cache, case.kv if kv is None else kv, meta.slot_mapping)
    return triton_kernels.paged_attention(
        q, cache, meta.block_tables, meta.seq_lens_tensor, case.scale, window, softcap,
        num_splits=num_splits,
    )  # fmt: skip


def _check(device, seq_lens, window=None, softcap=None, **shape):
    case = make_case([1] * len(seq_lens), seq_lens, device=device, dtype=_dtype(device), **shape)
    want, _ = reference(case, window, softcap)
    whole = _decode(case, 1, window, softcap)
    tol = _tol(device)
    torch.testing.assert_close(whole.float(), want, atol=tol, rtol=tol)
    for splits in SPLITS:
        out = _decode(case, splits, window, softcap)
        assert out.dtype == case.q.dtype and not out.isnan().any()
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(out, whole, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])  # MHA, groups 4 and 8
def test_splits_match_one_program_and_reference(device, heads, kv_heads):
    _check(device, SEQ_LENS, heads=heads, kv_heads=kv_heads)


def test_head_dim_128(device):
    _check(device, [201, 5], heads=4, kv_heads=2, head_dim=128)


@pytest.mark.parametrize("window", [1, 5, 70, 150])
def test_sliding_window(device, window):
    # 5: inside one range, the ranges before it empty; 70, 150: across range boundaries
    _check(device, SEQ_LENS, window=window, heads=4, kv_heads=2)


def test_softcap(device):
    _check(device, SEQ_LENS, softcap=2.0, heads=4, kv_heads=2)
    _check(device, [201, 9], softcap=2.0, window=70, heads=4, kv_heads=2)


def test_padding_rows_give_zeros(device):
    case = make_case([1, 1], [201, 67], device=device, dtype=_dtype(device))
    want, _ = reference(case)
    padded = with_padding(case.meta, 2)  # seq_len 0, slot -1
    q = torch.cat([case.q, torch.randn_like(case.q[:2])])
    kv = torch.cat([case.kv, torch.randn_like(case.kv[:2])])
    for splits in SPLITS:
        out = _decode(case, splits, meta=padded, q=q, kv=kv)
        torch.testing.assert_close(out[:2].float(), want, atol=_tol(device), rtol=_tol(device))
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_prefill_refuses_forced_splits():
    case = make_case([3], [3])
    qsl = case.meta.query_start_loc_tensor
    with pytest.raises(ValueError, match="1 in prefill"):
        triton_kernels.paged_attention(
            case.q, case.cache, case.meta.block_tables, case.meta.seq_lens_tensor, case.scale,
            query_start_loc=qsl, max_query_len=3, num_splits=2,
        )  # fmt: skip


# The automatic choice: (batch, kv_heads, max_context, block_n, sms) -> splits, rounded
# down to a power of two (NUM_SPLITS is a constexpr: each count is a compiled variant).


def _unrounded(batch: int, kv_heads: int, max_context: int, block_n: int, sms: int) -> int:
    """The count before rounding: SMs per (sequence, KV head) pair, ranges of at least two
    tiles of the table, at most MAX_SPLITS, at least 1."""
    return max(1, min(MAX_SPLITS, sms // (batch * kv_heads), max_context // (2 * block_n)))


def test_big_batch_does_not_split():
    assert decode_num_splits(64, 8, 8192, 64, 132) == 1
    assert decode_num_splits(17, 8, 8192, 64, 132) == 1  # 136 programs already fill 132 SMs


def test_small_batch_with_long_table_splits():
    assert decode_num_splits(1, 8, 8192, 64, 132) == MAX_SPLITS  # capped
    assert decode_num_splits(4, 8, 8192, 64, 132) == 4  # 32 programs * 4 fill 132 SMs
    assert decode_num_splits(1, 8, 300, 64, 132) == 2  # each range >= 2 tiles of the table


def test_rounds_down_to_a_power_of_two():
    assert decode_num_splits(3, 8, 8192, 64, 132) == 4  # 132 // 24 = 5 SMs per pair
    assert decode_num_splits(2, 8, 8192, 64, 132) == 8  # 132 // 16 = 8
    assert decode_num_splits(1, 8, 800, 64, 132) == 4  # 800 // 128 = 6 tile pairs
    assert decode_num_splits(1, 8, 4000, 64, 132) == 16  # 31 tile pairs, capped at 16
    assert decode_num_splits(1, 1, 8192, 64, 15) == 8  # 15 SMs


def test_short_table_does_not_split():
    assert decode_num_splits(1, 8, 127, 64, 132) == 1


def test_automatic_count_is_a_power_of_two_not_above_the_unrounded_one():
    """Over batch sizes, contexts (an eager step's table width), KV heads, tiles and SM
    counts: a power of two, at most the unrounded count and more than half of it; so a run
    meets at most five NUM_SPLITS variants (1, 2, 4, 8, 16)."""
    seen = set()
    for sms in (16, 78, 114, 132, 144):
        for kv_heads in (1, 2, 4, 8):
            for block_n in (32, 64):
                for batch in range(1, 70):
                    for max_context in range(0, 4200, 97):
                        args = (batch, kv_heads, max_context, block_n, sms)
                        splits, limit = decode_num_splits(*args), _unrounded(*args)
                        assert splits & (splits - 1) == 0, args  # a power of two
                        assert limit // 2 < splits <= limit, args
                        seen.add(splits)
    assert seen == {1, 2, 4, 8, 16} and MAX_SPLITS in seen


def test_automatic_choice_reads_shapes_not_lengths(monkeypatch):
    """Same shapes, different seq_lens: the same split count (a captured graph replays it)."""
    chosen = []
    split_decode = triton_kernels._split_decode

    def spy(*args, splits, **kwargs):
        chosen.append(splits)
        split_decode(*args, splits=splits, **kwargs)

    monkeypatch.setattr(triton_kernels, "_split_decode", spy)
    case = make_case([1], [300], heads=4, kv_heads=2)  # 75-block table row, 2 KV heads
    short = dataclasses.replace(case.meta, seq_lens_tensor=torch.tensor([3]))
    for meta in (case.meta, short):
        _decode(case, None, meta=meta)
    # CPU stands in 16 SMs: 16 // 2 programs = 8, but 300 keys allow 300 // 128 = 2
    assert chosen == [2, 2]
    torch.testing.assert_close(_decode(case, None), reference(case)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_with_other_lengths():
    """bf16 on CUDA: one capture of the automatic (split) decode, replayed for new lengths."""
    case = make_case([1, 1], [3000, 1500], heads=32, kv_heads=8, head_dim=128,
                     device="cuda", dtype=torch.bfloat16)  # fmt: skip
    cache = case.cache.clone()
    triton_kernels.store_kv(cache, case.kv, case.meta.slot_mapping)
    tables, lens = case.meta.block_tables, case.meta.seq_lens_tensor.clone()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert decode_num_splits(2, 8, tables.shape[1] * 4, 64, sms) > 1  # the split path runs
    attend = lambda: triton_kernels.paged_attention(case.q, cache, tables, lens, case.scale)
    attend()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    for new_lens in ([3000, 1500], [17, 2999], [0, 1]):
        lens.copy_(torch.tensor(new_lens))
        graph.replay()
        want = triton_kernels.paged_attention(case.q, cache, tables, lens, case.scale, num_splits=1)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
