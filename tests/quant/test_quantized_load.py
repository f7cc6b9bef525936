"""A GGUF loaded quantized computes what its dequantized twin computes."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_synth import synthetic_tensors, write_gguf

from tokenmill.attention import AttentionMetadata, ForwardContext
from tokenmill.loader import load_checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.models.native_decode import NativeDecode
from tokenmill.quant.plan import build_plan

BLOCK = 16


def build(ckpt, dtype: torch.dtype, quantization: str):
    plan = build_plan(quantization, ckpt.source.tensor_types())
    cls = resolve_model_class(ckpt.hf_config["architectures"])
    model = cls(ckpt.hf_config, dtype, max_positions=128, quant=plan)
    model.load_weights(ckpt.weights(dtype, keep_quantized=plan is not None))
    return model.eval()


@torch.no_grad()
def prefill_logits(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    shape = (2, 4, BLOCK, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[1, 2]], BLOCK)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(meta, caches))
    return model.compute_logits(hidden)


@pytest.mark.parametrize(
    "types",
    [
        [Q.Q4_0, Q.Q4_1, Q.Q4_K],  # all int4, exact
        [Q.Q8_0, Q.Q5_K, Q.Q6_K],  # int8 rows
        [Q.Q4_K, Q.Q2_K, Q.Q3_K, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16],  # mixed: int4/int8/dense
    ],
    ids=["int4", "int8", "mixed"],
)
@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_quantized_logits_follow_dequantized(tmp_path, types, tied, native_isa) -> None:
    """At each native ISA level and on the PyTorch fallback (``native_isa``)."""
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors(types, tied=tied))
    ckpt = load_checkpoint(str(path))
    reference = build(ckpt, torch.float32, "none")
    quantized = build(ckpt, torch.bfloat16, "gguf")
    ids = [1, 5, 9, 33, 2, 17, 60, 8, 8, 41, 3, 12]
    want = prefill_logits(reference, ids, torch.float32)
    got = prefill_logits(quantized, ids, torch.bfloat16)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99, cos


def test_quantized_model_is_smaller(tmp_path) -> None:
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors([Q.Q4_1]))
    ckpt = load_checkpoint(str(path))
    qkv = build(ckpt, torch.bfloat16, "gguf").model.layers[0].self_attn.qkv_proj
    assert qkv.method.name == "int4" and not hasattr(qkv, "weight")
    # 4 bits + a bf16 scale and zero per 32 weights: 0.625 bytes per weight
    assert qkv.method.weight_bytes(qkv) == qkv.in_features * qkv.out_features * 5 // 8


@torch.no_grad()
def decode_logits(model, prompts: list[list[int]], steps: int, fast=None) -> list[torch.Tensor]:
    """Prefill each prompt alone, then decode all of them together, ``steps`` times; the
    decodes through ``fast`` (a ``NativeDecode``) when given."""
    shape = (2, 32, BLOCK, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(shape) for _ in range(model.num_layers)]
    tables = [[3 + 2 * i, 4 + 2 * i] if i % 2 else [20 + i, 9 + i] for i in range(len(prompts))]
    lens, last = [], []
    for table, ids in zip(tables, prompts):  # scattered blocks for odd sequences
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [table], BLOCK)
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(meta, caches))
        last.append(int(model.compute_logits(hidden[-1:]).argmax()))
        lens.append(len(ids))
    out = []
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        meta = AttentionMetadata.build([1] * len(lens), lens, tables, BLOCK)
        positions = torch.tensor([n - 1 for n in lens])
        forward = fast or model
        logits = model.compute_logits(
            forward(torch.tensor(last), positions, ForwardContext(meta, caches))
        )
        out.append(logits)
        last = logits.argmax(-1).tolist()
    return out


def test_native_decode_layers_equal_the_per_op_path(tmp_path, native_level) -> None:
    path = write_gguf(tmp_path / "m.gguf", synthetic_tensors([Q.Q4_1, Q.Q4_K, Q.Q8_0]))
    model = build(load_checkpoint(str(path)), torch.float32, "gguf")
    fast = NativeDecode.build(model)
    assert fast is not None and model.ops.backend.name == "native"
    prompts = [[1, 5, 9, 33, 2], [7, 7, 8, 12, 40, 41, 3, 5, 1, 2, 60, 61, 19]]
    fused = decode_logits(model, prompts, steps=6, fast=fast)
    per_op = decode_logits(model, prompts, steps=6)  # PyTorch glue around the same kernels
    for a, b in zip(fused, per_op):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
