"""What a model declares and what it is built with: cache specs per layer, the one op
selection (attention backend + small-op kernels), and the step context reaching layers."""

from __future__ import annotations

import pytest
import torch
from _helpers import FAMILIES

from tokenmill import native
from tokenmill.attention import AttentionMetadata, InputEmbeds, StepContext
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache import KVCacheManager, make_kv_cache
from tokenmill.kv_cache.spec import FullAttention, SlidingWindow
from tokenmill.layers.ops import NATIVE_KERNELS, TORCH_KERNELS, select_ops
from tokenmill.models import resolve_model_class
from tokenmill.quant.plan import build_plan

CPU = torch.device("cpu")


def _ours(family: str, **kwargs):
    hf_cls, config = FAMILIES[family]  # tiny: built uninitialized on the CPU
    return resolve_model_class([hf_cls.__name__])(config().to_dict(), torch.float32, **kwargs)


def test_gemma3_declares_its_sliding_layers_and_llama_full_ones():
    specs = _ours("gemma3").cache_specs()
    assert specs == [
        SlidingWindow(2, 16, torch.float32, window=8),
        FullAttention(2, 16, torch.float32),
    ]
    assert all(type(s) is FullAttention for s in _ours("llama").cache_specs())
    # One page shape: one block table, and the manager itself (nothing per step on top).
    assert type(make_kv_cache(specs, 8, 4)) is KVCacheManager


def test_dense_models_select_the_reference_and_pytorch():
    ops = select_ops(CPU, torch.float32)
    assert ops.backend.name == "reference" and ops.kernels is TORCH_KERNELS
    model = _ours("llama", ops=ops)
    assert model.ops is ops
    assert all(layer.self_attn.backend is ops.backend for layer in model.model.layers)


def test_quantized_float32_on_cpu_selects_the_native_kernels(native_level):
    plan = build_plan("int8", {})
    ops = select_ops(CPU, torch.float32, plan)
    assert ops.backend.name == "native" and ops.kernels is NATIVE_KERNELS
    assert select_ops(CPU, torch.float32, plan, "reference").backend.name == "reference"
    # bfloat16 activations: the native attention can not run them, auto does not pick it.
    assert select_ops(CPU, torch.bfloat16, plan).backend.name == "reference"


def test_without_the_native_kernels_quantized_models_select_pytorch():
    plan = build_plan("int8", {})
    with native.use(None):
        ops = select_ops(CPU, torch.float32, plan)
        assert ops.backend.name == "reference" and ops.kernels is TORCH_KERNELS
        with pytest.raises(InvalidRequestError, match=r"AVX2\+FMA\+F16C and a C compiler"):
            select_ops(CPU, torch.float32, plan, "native")


def test_a_backend_that_can_not_run_the_model_is_an_error_not_a_switch():
    with pytest.raises(InvalidRequestError, match="computes in float32"):
        select_ops(CPU, torch.bfloat16, None, "native")
    with pytest.raises(InvalidRequestError, match="runs on CPU"):
        select_ops(torch.device("cuda"), torch.float32, None, "native")


def test_input_embeds_replace_their_rows():
    model = _ours("llama")
    model.model.embed_tokens.weight.data.normal_()
    meta = AttentionMetadata.build([3], [3], [[0]], 4)
    values = torch.full((1, model.config.hidden_size), 7.0)
    ctx = StepContext(meta, [], input_embeds=InputEmbeds(torch.tensor([1]), values))
    ids = torch.tensor([5, 6, 7])
    hidden = model.model.embed(ids, ctx)
    assert torch.equal(hidden[1], values[0])
    torch.testing.assert_close(hidden[[0, 2]], model.model.embed_tokens(ids[[0, 2]]))
