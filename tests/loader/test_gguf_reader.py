"""Our lazy GGUF reader and the GGUF weight stream, on synthetic files and tiny.gguf."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize as reference_dequantize
from gguf_synth import HEADS, KV_HEADS, synthetic_tensors, write_gguf

from tokenmill.errors import ModelLoadError, UnsupportedModelError
from tokenmill.loader import load_checkpoint
from tokenmill.loader.gguf_file import StringArray, read_gguf
from tokenmill.quant.ggml_codec import SUPPORTED_QUANT_TYPES

ALL_TYPES = sorted(SUPPORTED_QUANT_TYPES, key=lambda t: t.name)
_ATTENTION_MLP = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
}  # fmt: skip
HF_NAMES = {**_ATTENTION_MLP, "ffn_norm": "post_attention_layernorm"}
GEMMA3_HF_NAMES = {
    **_ATTENTION_MLP,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL_HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _expected_hf_name(gguf_name: str, arch: str = "llama") -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base in GLOBAL_HF_NAMES:
        return f"{GLOBAL_HF_NAMES[base]}.{suffix}"
    _, layer, leaf = base.split(".")
    names = GEMMA3_HF_NAMES if arch == "gemma3" else HF_NAMES
    return f"model.layers.{layer}.{names[leaf]}.{suffix}"


def _reference(raw: np.ndarray, qtype: Q, gguf_name: str, arch: str = "llama") -> torch.Tensor:
    """transformers' legacy GGUF path: numpy dequantize, then the llama Q/K un-permute or
    Gemma's norm offset."""
    w = reference_dequantize(raw, qtype)
    leaf = gguf_name.split(".")[-2]
    if arch == "gemma3" and leaf.endswith("norm"):
        w = w - 1
    n_head = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(leaf) if arch == "llama" else None
    if n_head:
        dim = w.shape[0] // n_head // 2
        w = w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
    return torch.from_numpy(np.array(w))


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> tuple[Path, dict]:
    tensors = synthetic_tensors(ALL_TYPES)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "synth.gguf", tensors), tensors


def test_reader_matches_gguf_reader(synth):
    path, _ = synth
    ours, ref = read_gguf(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.qtype == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in reversed(theirs.shape))
        assert np.array_equal(
            ours.raw(mine).ravel(), np.asarray(theirs.data).view(np.uint8).ravel()
        )
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.metadata[key] == pytest.approx(field.contents()), key


def test_reader_keeps_only_the_length_of_string_arrays(tinycoder_gguf):
    meta = read_gguf(tinycoder_gguf).metadata
    assert meta["tokenizer.ggml.tokens"] == StringArray(32000)
    assert meta["tokenizer.ggml.model"] == "llama"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stream_yields_every_type_dequantized_renamed_and_unpermuted(synth, dtype):
    path, tensors = synth
    ckpt = load_checkpoint(str(path))
    streamed = dict(ckpt.weights(dtype))
    assert set(streamed) == {_expected_hf_name(n) for n in tensors}
    for gguf_name, (raw, qtype) in tensors.items():
        got = streamed[_expected_hf_name(gguf_name)]
        assert got.dtype == dtype and got.is_contiguous()
        expected = _reference(raw, qtype, gguf_name).to(dtype)
        assert torch.equal(got, expected), gguf_name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_every_arch_streams_the_parameters_of_its_transformers_model(arch, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    tied = arch == "gemma3"
    tensors = synthetic_tensors([Q.Q8_0, Q.Q4_K], tied=tied, arch=arch)
    ckpt = load_checkpoint(str(write_gguf(tmp_path / f"{arch}.gguf", tensors, arch=arch)))
    config = dict(ckpt.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config)
        )
    assert type(model).__name__ == ckpt.hf_config["architectures"][0]
    assert model.config.head_dim == 64
    streamed = dict(ckpt.weights(torch.float32))
    assert set(streamed) == set(model.state_dict()) - ({"lm_head.weight"} if tied else set())
    for gguf_name, (raw, qtype) in tensors.items():
        expected = _reference(raw, qtype, gguf_name, arch)
        assert torch.equal(streamed[_expected_hf_name(gguf_name, arch)], expected), gguf_name


def test_config_from_metadata(synth):
    cfg = load_checkpoint(str(synth[0])).hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    assert cfg["rope_theta"] == 10000.0 and cfg["tie_word_embeddings"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["vocab_size"]) == (1, 2, 64)


def test_tied_when_no_output_tensor(tmp_path):
    path = write_gguf(tmp_path / "tied.gguf", synthetic_tensors([Q.Q8_0], layers=1, tied=True))
    ckpt = load_checkpoint(str(path))
    assert ckpt.hf_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in dict(ckpt.weights(torch.float32))


def test_unsupported_quant_type_is_named(tmp_path):
    tensors = synthetic_tensors([Q.Q8_0], layers=1)
    raw = np.zeros((128, 256 // 32 * 18), dtype=np.uint8)  # IQ4_NL: 32-element blocks of 18 bytes
    tensors["blk.0.attn_k.weight"] = (raw, Q.IQ4_NL)
    path = write_gguf(tmp_path / "iq.gguf", tensors)
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_k.weight is stored as IQ4_NL"):
        load_checkpoint(str(path))


def test_unknown_architecture_lists_supported(tmp_path):
    path = write_gguf(tmp_path / "x.gguf", synthetic_tensors([Q.F32], layers=1), arch="starcoder2")
    with pytest.raises(
        UnsupportedModelError, match="'starcoder2'.*supported: gemma3, llama, qwen2"
    ):
        load_checkpoint(str(path))


def test_unknown_tensor_name(tmp_path):
    tensors = synthetic_tensors([Q.F32], layers=1)
    tensors["blk.0.attn_qkv.weight"] = tensors.pop("blk.0.attn_q.weight")
    path = write_gguf(tmp_path / "qkv.gguf", tensors)
    with pytest.raises(UnsupportedModelError, match="'blk.0.attn_qkv.weight' has no Hugging Face"):
        load_checkpoint(str(path))


def test_truncated_file(synth, tmp_path):
    data = synth[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_checkpoint(str(cut))
    cut.write_bytes(data[:200])  # inside the header
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(str(cut))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(str(bad))
