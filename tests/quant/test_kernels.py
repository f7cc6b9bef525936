"""Quantized linears against dequantize-then-matmul, on random blocks of every GGUF type."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from quant_blocks import random_raw

from tokenmill.layers.linear import Linear, PackedLinear, VocabEmbedding
from tokenmill.quant.ggml_codec import SUPPORTED_QUANT_TYPES
from tokenmill.quant.gguf_blocks import INT4_EXACT_TYPES, INT8_EXACT_TYPES, GgufBlocks
from tokenmill.quant.methods import AffineGroupMethod, method_for


# Both implementations of each format, as a model loads them: native (each ISA level), PyTorch.
@pytest.fixture
def impl(native_isa):
    """The int4 / int8 methods a layer built now gets (``method_for``): the native kernel at
    each ISA level this CPU runs, PyTorch's under "fallback" (``native.use(None)``)."""
    methods = {name: method_for(name) for name in ("int4", "int8")}
    assert isinstance(methods["int4"], AffineGroupMethod) == (native_isa != "fallback")
    return methods


ROWS, COLS = 192, 512  # whole K-quant super-blocks; three packed int4 row blocks
TYPES = sorted(SUPPORTED_QUANT_TYPES, key=lambda t: t.name)


def blocks(qtype: Q, rows: int = ROWS, seed: int = 0) -> GgufBlocks:
    raw, _ = random_raw(qtype, rows, COLS, seed)
    return GgufBlocks(raw, qtype, (rows, COLS))


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dequantized path: float32 weights, the same bfloat16 inputs, float32 math."""
    return x.float() @ w.t()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_linear_matches_dequantized_matmul(impl, qtype, method, tokens, dtype) -> None:
    src = blocks(qtype)
    layer = Linear(COLS, ROWS, dtype=dtype, method=impl[method])
    layer.load_weight(src)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = layer(x)
    assert y.shape == (tokens, ROWS) and y.dtype == dtype
    exact = qtype in (INT4_EXACT_TYPES if method == "int4" else INT8_EXACT_TYPES)
    # Exact formats: only the rounding of scales (bf16 or f16), of the activations (bf16,
    # or int8 per group of 32 in the native kernel) and of the outputs. Rounded formats add
    # 1/254 of a row's (torch int8) or a group's (native int8) range per weight, or 1/30
    # of a group's range (int4).
    tol = 0.02 if exact else 0.03 if method == "int8" else 0.12
    assert rel_err(y, reference(x, src.dequantize())) < tol


@pytest.mark.parametrize(
    "qtype", sorted(INT4_EXACT_TYPES, key=lambda t: t.name), ids=lambda t: t.name
)
def test_int4_holds_4bit_blocks_exactly(impl, qtype) -> None:
    """One-hot inputs read single weights back: equal to the dequantized value up to bf16."""
    src = blocks(qtype)
    layer = Linear(COLS, ROWS, dtype=torch.bfloat16, method=impl["int4"])
    layer.load_weight(src)
    cols = torch.tensor([0, 1, 31, 32, 255, 256, 511])
    eye = torch.zeros(len(cols), COLS, dtype=torch.bfloat16)
    eye[torch.arange(len(cols)), cols] = 1
    got = layer(eye).float()  # [len(cols), ROWS]
    want = src.dequantize()[:, cols].t()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_any_input_shape_and_dtype(impl) -> None:
    src = blocks(Q.Q4_1)
    layer = Linear(COLS, ROWS, dtype=torch.float16, method=impl["int4"])
    layer.load_weight(src)
    x = torch.randn(2, 3, COLS)
    y = layer(x.half())
    assert y.shape == (2, 3, ROWS) and y.dtype == torch.float16
    assert rel_err(y.view(6, ROWS), reference(x.view(6, COLS), src.dequantize())) < 0.02


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_packed_shards_equal_one_matrix(impl, method) -> None:
    """q/k/v loaded shard by shard (row offsets 0, 128, 192) equal the stacked matrix."""
    sizes = [128, 64, 64]
    parts = [blocks(Q.Q4_K, n, seed=i) for i, n in enumerate(sizes)]
    packed = PackedLinear(COLS, sizes, dtype=torch.bfloat16, method=impl[method])
    for i, part in enumerate(parts):
        packed.load_weight(part, i)
    whole = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(2, COLS).bfloat16()
    assert rel_err(packed(x), reference(x, whole)) < 0.03


def test_bias_is_added(impl) -> None:
    layer = Linear(COLS, ROWS, bias=True, dtype=torch.bfloat16, method=impl["int8"])
    layer.load_weight(blocks(Q.Q8_0))
    layer.bias.copy_(torch.arange(ROWS, dtype=torch.bfloat16))
    x = torch.zeros(1, COLS, dtype=torch.bfloat16)
    assert torch.equal(layer(x)[0], layer.bias)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_int8_embedding_rows_and_tied_logits(impl, qtype) -> None:
    src = blocks(qtype)
    table = VocabEmbedding(ROWS, COLS, torch.bfloat16, impl["int8"])
    table.load_weight(src)
    dense = src.dequantize()
    ids = torch.tensor([0, 5, ROWS - 1])
    rows = table(ids)
    assert rows.dtype == torch.bfloat16
    assert rel_err(rows, dense[ids]) < 0.01  # one int8 rounding of the row's range
    x = torch.randn(2, COLS).bfloat16()
    assert rel_err(table.logits(x), reference(x, dense)) < 0.03


def test_dense_method_dequantizes_blocks() -> None:
    src = blocks(Q.Q5_1)
    layer = Linear(COLS, ROWS, dtype=torch.float32)
    layer.load_weight(src)
    assert torch.equal(layer.weight, src.dequantize())


def test_int4_rejects_partial_groups(impl) -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        Linear(48, 64, method=impl["int4"])


def test_native_q8_0_embedding_rows_are_exact(native_level) -> None:
    src = blocks(Q.Q8_0)
    table = VocabEmbedding(ROWS, COLS, torch.float32, AffineGroupMethod(8))
    table.load_weight(src)
    ids = torch.arange(ROWS)
    assert torch.equal(table(ids), src.dequantize())


def test_native_kernel_batches_like_single_rows(native_level) -> None:
    """Each token's result is independent of the batch it is computed in."""
    layer = Linear(COLS, ROWS, dtype=torch.float32, method=AffineGroupMethod(4))
    layer.load_weight(blocks(Q.Q4_0))
    x = torch.randn(9, COLS)
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(9)]))
