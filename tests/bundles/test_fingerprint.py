"""The bundle key changes with every input that changes what a load computes, and only then."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import tokenizers
import transformers

from tokenmill import native
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
    native_isa="avx512",
    tokenmill_version="0.1.0",
    torch_version="2.5.0",
    transformers_version="5.0.0",
    tokenizers_version="0.22.0",
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
    "native_isa": "avx2",
    "tokenmill_version": "0.2.0",
    "torch_version": "2.6.0",
    "transformers_version": "5.1.0",
    "tokenizers_version": "0.23.0",
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


@pytest.mark.parametrize(
    ("var", "value", "changes"),
    [("TOKENMILL_FP32_GEMM", "native", True), ("TOKENMILL_BF16_KERNEL", "fma", True),
     ("TOKENMILL_SCAN_KERNEL", "torch", False), ("TOKENMILL_NUM_THREADS", "1", False)],
)  # fmt: skip
def test_kernel_env_vars(tiny_llama_dir, monkeypatch, var, value, changes):
    """A kernel choice that changes the stored tensors changes the key; one a warm load
    makes again (the scans) or that changes no tensor (threads) keeps it."""
    before = _key(tiny_llama_dir)
    monkeypatch.setenv(var, value)
    assert (_key(tiny_llama_dir) != before) is changes


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


def test_library_versions_are_the_running_ones(tiny_llama_dir):
    inputs = bundle_inputs(EngineConfig(model=str(tiny_llama_dir)))
    assert inputs.transformers_version == transformers.__version__
    assert inputs.tokenizers_version == tokenizers.__version__


@pytest.fixture
def avx512_cpu(monkeypatch):
    """A CPU that runs both ISA levels (whatever this one runs); nothing is compiled."""
    if not hasattr(native, "default_isa"):
        pytest.skip("native.default_isa (the TOKENMILL_NATIVE_ISA levels) is not in this tree")
    flags = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}
    monkeypatch.setattr(native, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(native, "isas_available", lambda: ("avx512", "avx2"))
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.delenv("TOKENMILL_NATIVE_ISA", raising=False)
    native.default_isa.cache_clear()
    yield
    native.default_isa.cache_clear()  # re-read on this CPU by the next caller


def test_native_isa_env_changes_the_key(avx512_cpu, monkeypatch, tiny_llama_dir):
    """TOKENMILL_NATIVE_ISA picks the kernels' level: another level is another bundle."""
    best = bundle_inputs(EngineConfig(model=str(tiny_llama_dir)))
    monkeypatch.setenv("TOKENMILL_NATIVE_ISA", "avx2")
    native.default_isa.cache_clear()
    lower = bundle_inputs(EngineConfig(model=str(tiny_llama_dir)))
    assert (best.native_isa, lower.native_isa) == ("avx512", "avx2")
    assert best.cpu_features == lower.cpu_features  # the flags alone do not tell them apart
    assert fingerprint(best) != fingerprint(lower)


def test_native_isa_without_default_isa(monkeypatch, tiny_llama_dir):
    """A native package without ``default_isa`` (before it landed) still gives a key."""
    monkeypatch.setattr(native, "available", lambda: True)  # library() calls default_isa
    monkeypatch.delattr(native, "default_isa", raising=False)
    assert bundle_inputs(EngineConfig(model=str(tiny_llama_dir))).native_isa == ""
