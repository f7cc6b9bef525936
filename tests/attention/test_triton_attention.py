"""The triton backend against the reference backend on random paged batches.

On CPU the kernels run interpreted in float32; the ``gpu`` variants run compiled in
bfloat16 against the float32 reference of the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from _attn_cases import bound, make_case, reference, run, with_padding

triton = pytest.importorskip("triton")

from tokenmill.attention.backends import select_backend  # noqa: E402


def _backend(device: torch.device):
    return select_backend("triton", device)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _check(device, query_lens, seq_lens, window=None, softcap=None, **shape):
    case = make_case(query_lens, seq_lens, device=device, dtype=_dtype(device), **shape)
    out, cache = run(_backend(device), case, window, softcap)
    want, want_cache = reference(case, window, softcap)
    tol = 1e-5 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    assert torch.equal(cache.float(), want_cache)  # the store is an exact copy


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (6, 2), (8, 1)])
def test_decode_gqa_scattered_blocks(device, heads, kv_heads):
    _check(device, [1, 1, 1, 1], [1, 5, 9, 17], heads=heads, kv_heads=kv_heads)


def test_prefill_from_empty(device):
    _check(device, [5, 11, 1], [5, 11, 1])


def test_chunked_prefill_continues_cached_prefix(device):
    # a chunk after a cached prefix, a fresh prompt and a decode token in one batch
    _check(device, [3, 8, 1], [10, 8, 6])


def test_prefill_spans_several_query_and_key_tiles(device):
    _check(device, [70, 2], [135, 2], heads=4, kv_heads=2)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_sliding_window(device, window):
    _check(device, [1, 1], [3, 14], window=window)  # decode
    _check(device, [6, 4], [15, 4], window=window)  # chunked prefill and prefill
    _check(device, [1, 9], [150, 139], window=window)  # keys start past the first tile


def test_softcap(device):
    _check(device, [1, 1], [7, 10], softcap=2.0)
    _check(device, [5, 3], [5, 12], softcap=2.0, window=4)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(device, head_dim):
    _check(device, [1, 1], [6, 9], head_dim=head_dim)
    _check(device, [4, 2], [4, 7], head_dim=head_dim)


def test_padding_rows_store_nothing_and_output_zeros(device):
    case = make_case([1, 1, 1], [3, 9, 6], device=device, dtype=_dtype(device))
    want, want_cache = reference(case)
    padded = with_padding(case.meta, 2)
    q = torch.cat([case.q, torch.randn_like(case.q[:2])])
    kv = torch.cat([case.kv, torch.randn_like(case.kv[:2])])
    cache = case.cache.clone()
    out = bound(_backend(device), case).forward(q, kv, cache, padded)
    tol = 1e-5 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(out[:3].float(), want, atol=tol, rtol=tol)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert torch.equal(cache.float(), want_cache)  # the -1 slots wrote nowhere


def test_metadata_without_query_start_loc_tensor(device):
    import dataclasses

    case = make_case([3, 2], [7, 2], device=device, dtype=_dtype(device))
    meta = dataclasses.replace(case.meta, query_start_loc_tensor=None)
    out, _ = run(_backend(device), case, meta=meta)
    want, _ = reference(case)
    tol = 1e-5 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_int32_index_tensors(device):
    import dataclasses

    case = make_case([1, 3], [9, 7], device=device, dtype=_dtype(device))
    i32 = lambda t: t.to(torch.int32)
    meta = case.meta
    meta = dataclasses.replace(
        meta,
        slot_mapping=i32(meta.slot_mapping),
        block_tables=i32(meta.block_tables),
        seq_lens_tensor=i32(meta.seq_lens_tensor),
    )
    out, cache = run(_backend(device), case, meta=meta)
    want, want_cache = reference(case)
    tol = 1e-5 if device.type == "cpu" else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    assert torch.equal(cache.float(), want_cache)
