"""The quantization option: what auto means, what each choice stores, loud misuse."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill import native
from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.quant.plan import build_plan, resolve_quantization

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("dtype", "fmt", "expected"),
    [
        ("auto", "gguf", "gguf"),  # the CPU fast path
        ("bfloat16", "gguf", "gguf"),
        ("float32", "gguf", "none"),  # float32 asks for exact dequantized math
        ("float16", "gguf", "none"),
        ("auto", "hf", "none"),  # dense checkpoints stay dense unless asked
    ],
)
def test_auto(dtype, fmt, expected) -> None:
    assert resolve_quantization("auto", dtype, CPU, fmt) == expected


def test_auto_is_none_off_cpu() -> None:
    assert resolve_quantization("auto", "auto", torch.device("cuda"), "gguf") == "none"


def test_explicit_choices_are_checked() -> None:
    assert resolve_quantization("int8", "float32", CPU, "hf") == "int8"
    with pytest.raises(InvalidRequestError, match="not a GGUF"):
        resolve_quantization("gguf", "auto", CPU, "hf")
    with pytest.raises(InvalidRequestError, match="CPU kernels"):
        resolve_quantization("int4", "auto", torch.device("cuda"), "gguf")
    with pytest.raises(InvalidRequestError, match="quantization='int3'"):
        EngineConfig(quantization="int3")


def test_gguf_plan_keeps_each_tensor_format() -> None:
    types = {
        "model.embed_tokens.weight": Q.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_K,
        "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,  # Q4_K_M mixes types in qkv
        "model.layers.0.self_attn.o_proj.weight": Q.Q4_0,
        "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
        "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
        "model.layers.0.mlp.down_proj.weight": Q.F16,
    }
    plan = build_plan("gguf", types)
    pick = lambda name, sizes=(64,), k=64: plan.linear_method(name, sizes, k).name
    assert pick("model.layers.0.self_attn.qkv_proj") == "int8"
    assert pick("model.layers.0.self_attn.o_proj") == "int4"
    assert pick("model.layers.0.mlp.gate_up_proj") == "int4"
    assert pick("model.layers.0.mlp.down_proj") == "dense"
    # A shard off the layout's row blocks (native: 16 rows; torch int4: 64, int8: any).
    unaligned = "dense" if native.available() else "int8"
    assert pick("model.layers.0.mlp.gate_up_proj", sizes=(40, 40)) == unaligned
    assert plan.embedding_method("model.embed_tokens").name == "int8"


def test_none_has_no_plan_and_int4_plans_int8_tables() -> None:
    assert build_plan("none", {}) is None
    plan = build_plan("int4", {})
    assert plan.linear_method("lm_head", (128,), 64).name == "int4"
    assert plan.embedding_method("model.embed_tokens").name == "int8"
