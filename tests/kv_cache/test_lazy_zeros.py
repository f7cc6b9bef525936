"""Big CPU cache tensors come from zero pages (``spec.zeros``): zero, writable, alive."""

from __future__ import annotations

import gc

import torch

from tokenmill.kv_cache.spec import LAZY_ZEROS_BYTES, FullAttention, allocate_caches, zeros


def test_big_cpu_tensor_is_zero_writable_and_keeps_its_pages() -> None:
    shape = (2, 64, 16, 4, 64)  # 2 MiB of float32: over the threshold
    assert torch.empty(shape).numel() * 4 >= LAZY_ZEROS_BYTES
    x = zeros(shape, torch.float32, "cpu")
    gc.collect()  # the map is referenced by the tensor only
    assert x.shape == shape and x.dtype == torch.float32 and x.is_contiguous()
    assert not x.any()
    x[1, 63, 15, 3, 63] = 5.0
    x[0, 0, 0, 0, 0] = -1.0
    assert x.sum().item() == 4.0
    y = zeros(shape, torch.bfloat16, "cpu")
    assert y.dtype == torch.bfloat16 and not y.any()


def test_small_tensors_and_other_dtypes_are_plain_zeros() -> None:
    small = zeros((3, 5), torch.float16, "cpu")
    assert small.shape == (3, 5) and small.dtype == torch.float16 and not small.any()


def test_allocated_pages_are_zero() -> None:
    spec = FullAttention(num_kv_heads=2, head_dim=64, dtype=torch.float32)
    (cache,) = allocate_caches([spec], num_blocks=256, block_size=16, num_slots=1, device="cpu")
    assert cache is not None and cache.shape == (2, 256, 16, 2, 64) and not cache.any()
