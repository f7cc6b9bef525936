"""The Triton attention kernels compile for an H200 (sm_90), here on CPU.

The interpreted tests check what the kernels compute; these check that Triton's compiler
takes every variant the wrappers launch: decode (plain and split-KV, with its combine),
prefill, sliding window, softcap, head dims 64/128/256 and GQA groups 1 to 8, and the
K/V store, as bf16 on the device, each specialized as a real launch would be; and that
the block table's width, which changes from step to step, does not change the variant.
See tests/triton_aot.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from triton_aot import assert_builds

BF16 = torch.bfloat16


def attention(
    heads: int, kv_heads: int, head_dim: int, decode: bool, blocks: int = 8, **options
) -> None:
    """One paged_attention call on small CPU tensors (its launches are recorded); blocks:
    the block table's width (its row stride)."""
    from tokenmill.attention import triton_kernels

    batch, block_size = 2, 16
    q = torch.zeros(batch if decode else 24, heads, head_dim, dtype=BF16)
    cache = torch.zeros(2, blocks * batch, block_size, kv_heads, head_dim, dtype=BF16)
    tables = torch.arange(batch * blocks, dtype=torch.int64).view(batch, blocks)
    lens = torch.tensor([40, 100], dtype=torch.int64)
    if not decode:
        options |= {"query_start_loc": torch.tensor([0, 10, 24]), "max_query_len": 14}
    triton_kernels.paged_attention(q, cache, tables, lens, head_dim**-0.5, **options)


def store(kv_heads: int, head_dim: int) -> None:
    from tokenmill.attention import triton_kernels

    kv = torch.zeros(5, 2, kv_heads, head_dim, dtype=BF16)
    cache = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=BF16)
    triton_kernels.store_kv(cache, kv, torch.tensor([3, 17, -1, 40, 63]))


SPLIT = ["_decode_split_kernel", "_combine_splits_kernel"]
PLAIN = ["_paged_attention_kernel"]
CASES = {
    "decode-llama8b": functools.partial(attention, 32, 8, 128, True, num_splits=1),
    "decode-split-llama8b": functools.partial(attention, 32, 8, 128, True, num_splits=8),
    "decode-split-gemma": functools.partial(
        attention, 8, 4, 256, True, num_splits=3, sliding_window=512, softcap=50.0
    ),  # fmt: skip
    "decode-llama1b": functools.partial(attention, 32, 8, 64, True, num_splits=1),
    "decode-split-llama1b": functools.partial(attention, 32, 8, 64, True, num_splits=16),
    "prefill-llama1b": functools.partial(attention, 32, 8, 64, False),
    "decode-mha-d64-window": functools.partial(
        attention, 16, 16, 64, True, num_splits=1, sliding_window=4
    ),  # fmt: skip
    "prefill-llama8b": functools.partial(attention, 32, 8, 128, False),
    "prefill-window-d64": functools.partial(attention, 8, 1, 64, False, sliding_window=7),
    "prefill-softcap-d256": functools.partial(attention, 8, 4, 256, False, softcap=30.0),
    "store-kv-d128": functools.partial(store, 8, 128),
    "store-kv-d256": functools.partial(store, 1, 256),
}
# An eager step's block table is as wide as its longest sequence needs: its row stride
# (stride_bt) is 1, a multiple of 16 or neither from step to step. Unspecialized, it must
# not change the variant (the key) a launch compiles.
WIDTHS = (1, 16, 33)
WIDTH_BASES = ("decode-llama1b", "decode-split-llama1b", "prefill-llama1b")
for _base in WIDTH_BASES:
    for _width in WIDTHS:
        CASES[f"{_base}-w{_width}"] = functools.partial(CASES[_base], blocks=_width)
EXPECTED = {name: SPLIT if "split" in name else ["_store_kv_kernel"] if "store" in name else PLAIN
            for name in CASES}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_attention_kernels_compile_for_sm90(sm90_build, case):
    assert_builds(sm90_build[case], EXPECTED[case])


@pytest.mark.parametrize("base", WIDTH_BASES)
def test_table_width_shares_one_variant(sm90_build, base):
    """do_not_specialize on stride_bt: widths 1, 8, 16 and 33 give one specialization key
    (no constexpr 1, no divisibility hint), so a GPU compiles the kernel once."""
    keys = sm90_build[base]["keys"]
    assert "stride_bt:i32" in keys[0]  # a plain i32: neither a constexpr nor hinted
    for width in WIDTHS:
        assert sm90_build[f"{base}-w{width}"]["keys"] == keys, width
