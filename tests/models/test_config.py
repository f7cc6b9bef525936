"""ArchConfig.from_hf reads both transformers-4 and transformers-5 spellings."""

from __future__ import annotations

import json

import pytest
import transformers
from _helpers import FAMILIES

from tokenmill.errors import ModelLoadError, UnsupportedModelError
from tokenmill.layers.rotary import RopeConfig
from tokenmill.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ArchConfig

_BASE = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
}
_LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 2048,
}


def test_llama31_v4_and_v5_spellings_agree() -> None:
    v4 = {**_BASE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": _LLAMA31_SCALING}
    v5 = transformers.LlamaConfig(**_BASE, rope_parameters={**_LLAMA31_SCALING, "rope_theta": 5e5})
    cfg4, cfg5 = ArchConfig.from_hf(v4), ArchConfig.from_hf(v5.to_dict())
    assert (
        cfg4.rope
        == cfg5.rope
        == RopeConfig(
            theta=500000.0, scaling="llama3", factor=8.0, original_max_position_embeddings=2048
        )
    )
    assert cfg4.num_kv_heads == 4 and cfg4.head_dim == 16
    assert cfg4.layer_types == (FULL_ATTENTION,) * 4 and cfg4.sliding_window is None


def test_legacy_scaling_type_key() -> None:
    cfg = ArchConfig.from_hf({**_BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope.scaling == "linear" and cfg.rope.factor == 2.0


def test_gemma3_v4_config() -> None:
    v4 = {
        **_BASE,
        "model_type": "gemma3_text",
        "num_hidden_layers": 7,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    cfg = ArchConfig.from_hf(v4)
    assert cfg.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert cfg.rope_of(5) == RopeConfig(
        theta=1e6, scaling="linear", factor=8.0, original_max_position_embeddings=4096
    )
    assert cfg.rope_of(0) == RopeConfig(theta=1e4, original_max_position_embeddings=4096)
    assert cfg.window_of(0) == 512 and cfg.window_of(5) is None
    # class defaults that save_pretrained may drop
    assert cfg.head_dim == 256 and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings


def test_gemma3_v5_config_matches_v4() -> None:
    v5 = transformers.Gemma3TextConfig(
        **{**_BASE, "num_hidden_layers": 7},
        head_dim=256,
        sliding_window=512,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ).to_dict()
    cfg = ArchConfig.from_hf(v5)
    assert cfg.layer_types[5] == FULL_ATTENTION and cfg.layer_types.count(FULL_ATTENTION) == 1
    assert cfg.rope_of(5).factor == 8.0 and cfg.rope_of(0).theta == 1e4


def test_qwen2_unused_sliding_window_is_dropped() -> None:
    v4 = {**_BASE, "model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}
    cfg = ArchConfig.from_hf(v4)
    assert cfg.sliding_window is None and cfg.layer_types == (FULL_ATTENTION,) * 4


def test_qwen2_sliding_from_max_window_layers() -> None:
    d = {
        **_BASE,
        "model_type": "qwen2",
        "sliding_window": 64,
        "use_sliding_window": True,
        "max_window_layers": 3,
    }
    assert ArchConfig.from_hf(d).layer_types == (FULL_ATTENTION,) * 3 + (SLIDING_ATTENTION,)


def test_mistral_window_applies_to_all_layers() -> None:
    cfg = ArchConfig.from_hf({**_BASE, "model_type": "mistral", "sliding_window": 4096})
    assert cfg.layer_types == (SLIDING_ATTENTION,) * 4 and cfg.window_of(3) == 4096
    cfg = ArchConfig.from_hf({**_BASE, "model_type": "mistral", "sliding_window": None})
    assert cfg.window_of(3) is None


def test_missing_key_is_named() -> None:
    d = dict(_BASE)
    del d["intermediate_size"]
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        ArchConfig.from_hf(d)


def test_unsupported_rope_scaling() -> None:
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ArchConfig.from_hf({**_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_bad_gqa_ratio() -> None:
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        ArchConfig.from_hf({**_BASE, "num_key_value_heads": 3})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saved_config_json_reads_like_to_dict(family: str, tmp_path) -> None:
    """save_pretrained drops keys equal to defaults; the result must normalize the same."""
    config = FAMILIES[family][1]()
    config.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert ArchConfig.from_hf(on_disk) == ArchConfig.from_hf(config.to_dict())
