"""Streaming weight loading: packed shards, tied heads, and loud failures."""

from __future__ import annotations

import pytest
import torch
from _helpers import build_hf

from tokenmill.errors import ModelLoadError
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3 import Qwen3ForCausalLM


@pytest.fixture(scope="module")
def llama_hf():
    return build_hf("llama")


def _fresh(hf) -> LlamaForCausalLM:
    return LlamaForCausalLM(hf.config.to_dict(), torch.float32)


def test_packed_shards_land_in_place(llama_hf) -> None:
    ours = _fresh(llama_hf)
    loaded = ours.load_weights(llama_hf.state_dict().items())
    assert "model.layers.1.self_attn.qkv_proj.weight" in loaded
    qkv = ours.model.layers[1].self_attn.qkv_proj.weight
    attn = llama_hf.model.layers[1].self_attn
    expected = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(qkv, expected)


def test_loading_casts_to_model_dtype(llama_hf) -> None:
    ours = LlamaForCausalLM(llama_hf.config.to_dict(), torch.bfloat16)
    ours.load_weights(llama_hf.state_dict().items())
    assert ours.lm_head.weight.dtype == torch.bfloat16


def test_ignores_rotary_buffers(llama_hf) -> None:
    stream = [
        *llama_hf.state_dict().items(),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)),
    ]
    _fresh(llama_hf).load_weights(stream)


def test_unexpected_name_raises(llama_hf) -> None:
    stream = [*llama_hf.state_dict().items(), ("model.layers.9.mlp.up_proj.weight", torch.ones(1))]
    with pytest.raises(ModelLoadError, match="layers.9"):
        _fresh(llama_hf).load_weights(stream)


def test_missing_shard_raises(llama_hf) -> None:
    stream = [
        (n, t)
        for n, t in llama_hf.state_dict().items()
        if n != "model.layers.0.self_attn.k_proj.weight"
    ]
    with pytest.raises(ModelLoadError, match="layers.0.self_attn.qkv_proj.weight"):
        _fresh(llama_hf).load_weights(stream)


def test_shape_mismatch_raises(llama_hf) -> None:
    stream = [
        (n, t[:-1] if n.endswith("down_proj.weight") else t)
        for n, t in llama_hf.state_dict().items()
    ]
    with pytest.raises(ModelLoadError, match="shape"):
        _fresh(llama_hf).load_weights(stream)


def test_untied_head_must_be_present(llama_hf) -> None:
    stream = [(n, t) for n, t in llama_hf.state_dict().items() if n != "lm_head.weight"]
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        _fresh(llama_hf).load_weights(stream)


def test_tied_head_is_optional() -> None:
    hf = build_hf("qwen3")
    names = {n for n, _ in hf.state_dict().items()}
    ours = Qwen3ForCausalLM(hf.config.to_dict(), torch.float32)
    ours.load_weights((n, t) for n, t in hf.state_dict().items() if n != "lm_head.weight")
    assert ours.lm_head is None and "lm_head.weight" in names
