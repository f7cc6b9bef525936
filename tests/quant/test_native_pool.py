"""The native kernels' thread pool (``kernels/pool.c``): every parallel kernel gives the same
bits with 1, 2 or 3 threads (each piece computes the same values whoever runs it), also
when two Python threads call at once (one runs inline) and in a forked child (the helpers
are started again)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from tokenmill import native
from tokenmill.native import dense16

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable here")


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _dense16(m: int, n: int, k: int, kernel: str) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(m + n + k)
    kid, dtype = dense16.KERNELS[kernel]
    tiles = dense16.empty_tiles(n, k, dtype)
    w = torch.randn(n, k, generator=g)
    dense16.write_rows(tiles, 0, w)
    x = torch.randn(m, k, generator=g)
    return lambda: dense16.gemm(x, tiles, kid, n)


def _affine(m: int, n: int, k: int, bits: int) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(m * n + k)
    codes = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01
    offset = torch.randn(n, k // 32, generator=g) * 0.01
    tiles = native.pack_tiles(codes, scale, offset, bits)
    x = torch.randn(m, k, generator=g)
    return lambda: native.affine_gemm(x, tiles, bits, n)


def _attention(batch: int, length: int) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 100 + length)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    blocks = batch * (-(-length // bs))
    cache = torch.randn(2, blocks, bs, kv_heads, d, generator=g)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, generator=g)
    tables = torch.randperm(blocks, generator=g).view(batch, -1)
    lens = torch.randint(1, length + 1, (batch,), generator=g)
    return lambda: native.decode_attention(
        qkv, heads, kv_heads, d, cache, tables, lens, int(lens.max()), d**-0.5, None
    )


def _norm(rows: int, dim: int) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(rows + dim)
    x, res, w = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g), torch.randn(dim, generator=g)  # fmt: skip

    def run() -> torch.Tensor:
        r = res.clone()
        return torch.cat((native.add_rms_norm(x, r, w, 1e-6), r))

    return run


def _rope(tokens: int) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(tokens, d, generator=g), torch.randn(tokens, d, generator=g)
    slots = torch.randperm(tokens * 2, generator=g)[:tokens]

    def run() -> torch.Tensor:
        q, cache = qkv.clone(), torch.zeros(2, 2 * tokens, 1, kv_heads, d)
        native.rope_store_kv(q, heads, kv_heads, d, cos, sin, cache, slots)
        return torch.cat((q.flatten(), cache.flatten()))

    return run


def _cases() -> dict[str, Callable[[], torch.Tensor]]:
    bf16 = "bf16-avx512bf16" if dense16.has_avx512_bf16() else "bf16-fma"
    return {
        "dense16 GEMV, many pieces": _dense16(1, 4099, 576, bf16),
        "dense16 GEMM, odd sizes": _dense16(37, 333, 97, bf16),
        "dense16 GEMM, long rows (parallel prepare)": _dense16(64, 100, 1537, bf16),
        "dense16 fp16 fallback": _dense16(5, 1000, 130, "fp16-fma"),
        "dense16 bf16 fallback": _dense16(9, 515, 64, "bf16-fma"),
        "dense16 one tile": _dense16(3, 7, 33, bf16),
        "affine int4 GEMV": _affine(1, 2048, 576, 4),
        "affine int8 GEMM (parallel quantize)": _affine(33, 160, 512, 8),
        "decode attention": _attention(13, 70),
        "add_rms_norm (parallel rows)": _norm(129, 576),
        "rope_store_kv (parallel tokens)": _rope(40),
    }


def test_same_bits_for_any_thread_count(threads) -> None:
    cases = _cases()
    threads(1)
    serial = {name: run() for name, run in cases.items()}
    for n in (2, 3):
        threads(n)
        for name, run in cases.items():
            for _ in range(3):  # pieces land on different threads each time
                assert torch.equal(run(), serial[name]), f"{name}, {n} threads"


def test_dense16_gemm_matches_matmul_with_threads(threads) -> None:
    threads(2)
    g = torch.Generator().manual_seed(5)
    for m, n, k in ((1, 4099, 576), (32, 960, 576), (17, 49, 1536)):
        w = torch.randn(n, k, generator=g).bfloat16()
        tiles = dense16.empty_tiles(n, k, torch.bfloat16)
        dense16.write_rows(tiles, 0, w)
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T
        for kernel in ("bf16-fma", "bf16-avx512bf16"):
            if kernel == "bf16-avx512bf16" and not dense16.has_avx512_bf16():
                continue
            y = dense16.gemm(x, tiles, dense16.KERNELS[kernel][0], n)
            assert (y.double() - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_two_callers_at_once(threads) -> None:
    """One job at a time: the second caller runs its loop inline, and both are right."""
    threads(2)
    cases = list(_cases().values())
    expected = [run() for run in cases]
    failures: list[int] = []

    def worker(offset: int) -> None:
        for i in range(40):
            j = (i + offset) % len(cases)
            if not torch.equal(cases[j](), expected[j]):
                failures.append(j)

    pool = [threading.Thread(target=worker, args=(o,)) for o in (0, 5)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_restarts_the_helpers(threads) -> None:
    threads(2)
    run = _dense16(8, 2000, 576, "bf16-fma")
    expected = run()  # the parent's helpers are running now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: helpers are gone until the pool starts them again
        ok = all(torch.equal(run(), expected) for _ in range(5))
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
