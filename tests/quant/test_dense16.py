"""16-bit float weights (bf16 / fp16) with float32 activations against torch.matmul, for
every kernel (the AVX512-BF16 one where the CPU has it, the FMA fallbacks everywhere),
on random and odd shapes; the plan's choice for HF checkpoints."""

from __future__ import annotations

import pytest
import torch

from tokenmill import native
from tokenmill.layers.linear import Linear, PackedLinear, VocabEmbedding
from tokenmill.native import dense16
from tokenmill.quant.dense16 import Dense16Method
from tokenmill.quant.plan import resolve_quantization

pytestmark = pytest.mark.usefixtures("native_level")  # every ISA level this CPU runs


def _kernels() -> list:
    needs = {
        "bf16-avx512bf16": (dense16.has_avx512_bf16, "no AVX512-BF16 here"),
        "bf16-avx512bf16-1": (dense16.has_avx512_bf16, "no AVX512-BF16 here"),
        "bf16-amx": (dense16.has_amx, "no AMX-BF16 here (or the OS refuses its tile state)"),
    }
    out = []
    for k in dense16.KERNELS:
        if k in needs:
            ok, why = needs[k]
            k = pytest.param(
                k, marks=pytest.mark.skipif(native.available() and not ok(), reason=why)
            )
        out.append(k)
    return out


# The AVX512-BF16 and AMX kernels keep activations to 16 significant bits (hi + lo bfloat16);
# the one-term kernel rounds them to bfloat16, exactly as the reference then does.
TOLERANCE = {"bf16-avx512bf16": 2e-5, "bf16-amx": 2e-5, "bf16-fma": 2e-6, "fp16-fma": 2e-6,
             "fp32-fma": 2e-6, "bf16-avx512bf16-1": 2e-6}  # fmt: skip
SHAPES = [(1, 576, 576), (4, 192, 576), (5, 49, 33), (3, 37, 19), (7, 17, 1), (1, 1, 2),
          (33, 100, 301), (130, 64, 64)]  # fmt: skip


def _skip_where_not_built(kernel: str) -> None:
    """The one-term kernel where this ISA level's library lacks AVX512-BF16 (the AVX2 one):
    the C code would run the FMA kernel, which best_kernel never lets a model choose."""
    if kernel == dense16.ONE_TERM_KERNEL and not dense16.has_avx512_bf16():
        pytest.skip("the one-term kernel is not built at this ISA level")


def _reference(x: torch.Tensor, w: torch.Tensor, kernel: str) -> torch.Tensor:
    if kernel == dense16.ONE_TERM_KERNEL:  # activations rounded to bfloat16 (nearest even)
        x = x.bfloat16()
    return torch.matmul(x.double(), w.double().T)


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_matches_matmul(kernel: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    _skip_where_not_built(kernel)
    dtype = dense16.KERNELS[kernel][1]
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    layer = Linear(k, n, method=Dense16Method(kernel))
    layer.load_weight(w.float())
    y = layer(x)
    ref = _reference(x, w, kernel)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < TOLERANCE[kernel], f"{kernel} {shape}: relative error {err:.2e}"


@pytest.mark.parametrize("kernel", _kernels())
def test_kernels_agree_with_the_fallback(kernel: str) -> None:
    """Every kernel against the plain FMA path on a model-sized GEMV and GEMM."""
    _skip_where_not_built(kernel)
    dtype = dense16.KERNELS[kernel][1]
    fallback = "fp16-fma" if dtype == torch.float16 else "bf16-fma"
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1536, 576, generator=g).to(dtype)
    ours, base = (
        Linear(576, 1536, method=Dense16Method(kernel)),
        Linear(576, 1536, method=Dense16Method(fallback)),
    )
    ours.load_weight(w)
    base.load_weight(w)
    for m in (1, 32):
        x = torch.randn(m, 576, generator=g)
        # float32 weights: against PyTorch's own float32 product
        xb = x.bfloat16().float() if kernel == dense16.ONE_TERM_KERNEL else x
        a, b = ours(x), x @ w.T if dtype == torch.float32 else base(xb)
        assert (a - b).abs().max() <= TOLERANCE[kernel] * b.abs().max()


def test_shards_at_unaligned_rows_and_embedding_rows() -> None:
    """Packed shards whose offsets are no multiple of the 16-row tile; rows read back exact."""
    sizes, k = (9, 23, 5), 45
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, k, generator=g).bfloat16() for n in sizes]
    layer = PackedLinear(k, sizes, method=Dense16Method("bf16-fma"))
    for i, p in enumerate(parts):
        layer.load_weight(p.float(), shard=i)
    w = torch.cat(parts)
    x = torch.randn(3, 5, k, generator=g)  # a 3-D input goes through the reshape path
    torch.testing.assert_close(layer(x), (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)
    table = VocabEmbedding(37, k, dtype=torch.float32, method=Dense16Method("bf16-fma"))
    table.load_weight(w)
    ids = torch.tensor([0, 36, 17, 16, 15, 5])
    assert torch.equal(table(ids), w[ids].float())
    assert torch.equal(table.logits(x[0]), layer(x[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [45, 64])
def test_read_rows_widen_exactly(dtype: torch.dtype, k: int) -> None:
    """Embedding rows read from the tiles (the native reader, and the indexing fallback)
    are the stored values widened to float32, in the order asked, repeats included."""
    n = 37
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    tiles = dense16.empty_tiles(n, k, dtype)
    dense16.write_rows(tiles, 0, w)
    ids = torch.tensor([0, 36, 17, 16, 15, 5, 17])
    expected = w[ids].float()
    assert torch.equal(dense16.read_rows(tiles, ids, k), expected)
    with native.use(None):
        assert torch.equal(dense16.read_rows(tiles, ids, k), expected)


def test_best_kernel_follows_the_cpu() -> None:
    expected = "bf16-amx" if dense16.has_amx() else "bf16-fma"
    assert dense16.best_kernel(torch.bfloat16) == expected
    assert dense16.best_kernel(torch.float16) == "fp16-fma"
    assert dense16.best_kernel(torch.float32) == "fp32-fma"


@pytest.mark.parametrize(
    ("choice", "kernel"),
    [("fma", "bf16-fma"), ("avx512bf16", "bf16-avx512bf16"), ("amx", "bf16-amx")],
)
def test_the_bf16_kernel_can_be_chosen(monkeypatch, choice, kernel) -> None:
    """``TOKENMILL_BF16_KERNEL`` picks the kernel; one this CPU (or the library at this
    level) can not run is a ValueError naming the variable, never an illegal instruction."""
    monkeypatch.setenv("TOKENMILL_BF16_KERNEL", choice)
    runs = {"fma": native.available(), "avx512bf16": dense16.has_avx512_bf16(),
            "amx": dense16.has_amx()}[choice]  # fmt: skip
    if runs:
        assert dense16.best_kernel(torch.bfloat16) == kernel
    else:
        with pytest.raises(ValueError, match="TOKENMILL_BF16_KERNEL"):
            dense16.best_kernel(torch.bfloat16)
    monkeypatch.setenv("TOKENMILL_BF16_KERNEL", "tiles")
    with pytest.raises(ValueError, match="use auto, amx, avx512bf16 or fma"):
        dense16.best_kernel(torch.bfloat16)


@pytest.mark.parametrize(
    ("stored", "dtype", "expected"),
    [(torch.bfloat16, "auto", "bf16"), (torch.float16, "auto", "fp16"),
     (torch.float32, "auto", "none"), (None, "auto", "none"),
     (torch.bfloat16, "float32", "none"), (torch.bfloat16, "bfloat16", "none")],
)  # fmt: skip
def test_auto_keeps_16bit_hf_checkpoints(monkeypatch, stored, dtype, expected) -> None:
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", "torch")  # float32: PyTorch's BLAS
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", dtype, cpu, "hf", stored) == expected
    assert resolve_quantization("auto", "auto", torch.device("cuda"), "hf", stored) == "none"


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
@pytest.mark.parametrize("gemm", ["native", "torch", "auto"])
def test_float32_checkpoints_take_the_native_kernel_where_it_wins(monkeypatch, gemm) -> None:
    """With ``TOKENMILL_FP32_GEMM=native`` a float32 folder (or any float folder at
    dtype=float32) takes the native float32 kernel; with auto, where it beats PyTorch's
    BLAS (``fp32_native``: an AVX-512 CPU not Intel's); with torch it stays dense."""
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", gemm)
    wins = gemm == "native" or (gemm == "auto" and dense16.fp32_native())
    expected = "fp32" if wins else "none"
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", "auto", cpu, "hf", torch.float32) == expected
    assert resolve_quantization("auto", "float32", cpu, "hf", torch.float32) == expected
    assert resolve_quantization("auto", "float32", cpu, "hf", torch.bfloat16) == expected
    assert resolve_quantization("auto", "auto", cpu, "hf", torch.bfloat16) == "bf16"
    assert resolve_quantization("auto", "float32", cpu, "hf", None) == "none"  # mixed dtypes
    assert resolve_quantization("auto", "float32", cpu, "gguf", None) == "none"
    assert resolve_quantization("none", "float32", cpu, "hf", torch.float32) == "none"


def test_auto_without_the_kernels_keeps_hf_checkpoints_dense() -> None:
    """Where the native kernels are off, a 16-bit folder loads as dense weights (PyTorch)."""
    with native.use(None):
        assert (
            resolve_quantization("auto", "auto", torch.device("cpu"), "hf", torch.bfloat16)
            == "none"
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_term_is_refused_off_bfloat16(dtype) -> None:
    with pytest.raises(ValueError, match="activation_precision='low'"):
        dense16.best_kernel(dtype, activation_terms=1)


def test_one_term_kernel_differs_from_two_terms() -> None:
    """activation_precision="low" on bf16 weights really rounds the activations."""
    if not dense16.has_avx512_bf16():
        pytest.skip("no AVX512-BF16 here")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 576, generator=g).bfloat16()
    x = torch.randn(3, 576, generator=g)
    layers = [
        Linear(576, 64, method=Dense16Method(k)) for k in ("bf16-avx512bf16", "bf16-avx512bf16-1")
    ]
    for layer in layers:
        layer.load_weight(w)
    two, one = (layer(x) for layer in layers)
    assert (two - one).abs().max() > 1e-4 * two.abs().max()
