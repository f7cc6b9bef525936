"""The bundle key changes with every input that changes what a load computes, and only then."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tokenmill.bundles.fingerprint import (
    BundleInputs,
    FileIdentity,
    bundle_inputs,
    fingerprint,
)
from tokenmill.config import EngineConfig

BASE = BundleInputs(
    architecture="LlamaForCausalLM",
    model_config='{"hidden_size":64}',
    files=(FileIdentity("model.safetensors", 100, 1, None),),
    dtype="auto",
    quantization="auto",
    device="cpu",
    cpu_features=("x86_64", "avx512f", "native=True"),
    tokenmill_version="0.1.0",
    torch_version="2.5.0",
    format_version=1,
    layout='{"max_model_len":null}',
)

CHANGED = {
    "architecture": "Qwen2ForCausalLM",
    "model_config": '{"hidden_size":128}',
    "files": (FileIdentity("model.safetensors", 100, 2, None),),
    "dtype": "float32",
    "quantization": "int8",
    "device": "cuda-sm90",
    "cpu_features": ("x86_64", "avx512f", "native=False"),
    "tokenmill_version": "0.2.0",
    "torch_version": "2.6.0",
    "format_version": 2,
    "layout": '{"max_model_len":512}',
}


def test_every_field_is_covered():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(BundleInputs)}


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_field_changes_the_key(field):
    assert fingerprint(dataclasses.replace(BASE, **{field: CHANGED[field]})) != fingerprint(BASE)


def test_key_is_stable():
    assert fingerprint(BASE) == fingerprint(dataclasses.replace(BASE))


def _key(model, **options) -> str:
    return fingerprint(bundle_inputs(EngineConfig(model=str(model), **options)))


# Options of EngineConfig that change the tensors a load builds -> a second value.
LOAD_OPTIONS = {
    "dtype": "bfloat16",
    "quantization": "int8",
    "max_model_len": 128,
    "attention_backend": "reference",
}
# Options that only change scheduling, sampling or the KV cache: same bundle.
KEPT_OPTIONS = {
    "max_num_seqs": 3,
    "seed": 7,
    "block_size": 4,
    "num_kv_blocks": 32,
    "kv_cache_memory_bytes": 1 << 20,
    "max_num_batched_tokens": 4096,
    "enable_prefix_caching": False,
    "max_logprobs": 5,
    "served_model_name": "x",
    "async_scheduling": "off",
    "engine_cache_max_size_gb": 1.0,
    "prepare_bundle": True,
}


@pytest.mark.parametrize("option", sorted(LOAD_OPTIONS))
def test_load_options_change_the_key(tiny_llama_dir, option):
    assert _key(tiny_llama_dir, **{option: LOAD_OPTIONS[option]}) != _key(tiny_llama_dir)


@pytest.mark.parametrize("option", sorted(KEPT_OPTIONS))
def test_other_options_keep_the_key(tiny_llama_dir, option):
    assert _key(tiny_llama_dir, **{option: KEPT_OPTIONS[option]}) == _key(tiny_llama_dir)


def test_tokenizer_override_changes_the_key(tiny_llama_dir):
    assert _key(tiny_llama_dir, tokenizer=str(tiny_llama_dir)) != _key(tiny_llama_dir)


@pytest.fixture
def folder(tiny_llama_dir, tmp_path):
    """A copy of the tiny model whose files a test may edit."""
    for f in tiny_llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


@pytest.mark.parametrize(
    "field, value",
    [("num_hidden_layers", 3), ("rope_theta", 500000.0), ("rms_norm_eps", 1e-5),
     ("architectures", ["MistralForCausalLM"]), ("tie_word_embeddings", True)],
)  # fmt: skip
def test_config_fields_change_the_key(folder, field, value):
    before = _key(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    assert _key(folder) != before


def test_ignored_config_fields_keep_the_config_part(folder):
    before = bundle_inputs(EngineConfig(model=str(folder)))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["transformers_version"] = "9.9.9"
    (folder / "config.json").write_text(json.dumps(cfg))
    after = bundle_inputs(EngineConfig(model=str(folder)))
    assert after.model_config == before.model_config  # the file's own hash still changed
    assert after.files != before.files


def test_weight_file_identity(folder):
    """A big file enters by size + mtime_ns: touching it is a new key, the same stat is not."""
    weights = folder / "model.safetensors"
    before = _key(folder)
    assert _key(folder) == before
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert _key(folder) != before


def test_small_file_content(folder):
    """Small files enter by content: an edit with the same size and mtime is a new key."""
    path = folder / "generation_config.json"
    st = path.stat()
    before = _key(folder)
    text = path.read_text()
    path.write_text(text.replace("1", "3", 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
    assert _key(folder) != before


def test_gguf_file(smollm2_gguf):
    inputs = bundle_inputs(EngineConfig(model=str(smollm2_gguf)))
    assert [f.name for f in inputs.files] == [smollm2_gguf.name]
    assert inputs.files[0].sha256 is None  # big: size + mtime_ns
    assert inputs.architecture == ""  # read from the file only when loading
