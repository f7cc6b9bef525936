"""Real GGUF files: our stream and config equal what transformers' GGUF loader builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.loader import load_checkpoint

# Config keys the model code reads, compared with transformers' config of the same file.
MODEL_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "rope_parameters", "bos_token_id",
    "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "hidden_act",
)  # fmt: skip
GEMMA3_KEYS = (
    "hidden_activation", "layer_types", "sliding_window", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
)  # fmt: skip


def reference_model(path: Path):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


def assert_same_weights(path: Path, reference) -> None:
    expected = reference.state_dict()
    ckpt = load_checkpoint(str(path))
    seen = set()
    for name, tensor in ckpt.weights(torch.float32):
        assert name in expected, f"{name} is not a parameter of {type(reference).__name__}"
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name
        seen.add(name)
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    assert set(expected) - seen == tied


def assert_same_config(path: Path, reference, keys: tuple[str, ...]) -> None:
    ours, theirs = load_checkpoint(str(path)).hf_config, reference.config.to_dict()
    for key in keys:
        assert ours.get(key) == theirs.get(key), key


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    return reference_model(smollm2_gguf)


def test_smollm2_weights_equal_transformers(smollm2_gguf, smollm2_reference):
    assert_same_weights(smollm2_gguf, smollm2_reference)


def test_smollm2_config_equals_transformers(smollm2_gguf, smollm2_reference):
    assert_same_config(smollm2_gguf, smollm2_reference, MODEL_KEYS)
    cfg = load_checkpoint(str(smollm2_gguf)).hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["rope_theta"], cfg["head_dim"], cfg["tie_word_embeddings"]) == (100000.0, 64, True)


def test_tinycoder_weights_and_config_equal_transformers(tinycoder_gguf):
    reference = reference_model(tinycoder_gguf)
    assert_same_weights(tinycoder_gguf, reference)
    assert_same_config(tinycoder_gguf, reference, MODEL_KEYS)
    assert load_checkpoint(str(tinycoder_gguf)).hf_config["vocab_size"] == 32000  # from the tokens


def test_gemma3_config_without_transformers(gemma3_gguf):
    cfg = load_checkpoint(str(gemma3_gguf)).hf_config
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert (cfg["rope_theta"], cfg["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["sliding_window"]) == (256, 1, 512)
    assert cfg["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["tie_word_embeddings"] is True


@pytest.mark.slow
def test_gemma3_weights_and_config_equal_transformers(gemma3_gguf):
    reference = reference_model(gemma3_gguf)  # ~40 s on two cores
    assert_same_weights(gemma3_gguf, reference)
    assert_same_config(gemma3_gguf, reference, MODEL_KEYS + GEMMA3_KEYS)
