"""Hugging Face folders: tensors stream back equal; every broken folder says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tokenmill.errors import ModelLoadError
from tokenmill.loader import load_checkpoint
from tokenmill.loader.hf import INDEX_FILE, SINGLE_FILE


def _tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, rope_theta=50000.0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return _tiny_llama(tie=False)


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory, model) -> Path:
    path = tmp_path_factory.mktemp("single")
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=[2, 7], temperature=0.6, do_sample=True).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, model) -> Path:
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="20KB")
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("folder", ["single_dir", "sharded_dir"])
def test_stream_equals_state_dict(request, model, folder):
    path = request.getfixturevalue(folder)
    ckpt = load_checkpoint(str(path))
    assert ckpt.format == "hf" and ckpt.path == str(path)
    expected = model.state_dict()
    streamed = {}
    for name, tensor in ckpt.weights(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        streamed[name] = tensor
    assert set(streamed) == set(expected)
    for name, tensor in streamed.items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_sharded_really_has_shards(sharded_dir):
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (sharded_dir / SINGLE_FILE).exists()


def test_tied_checkpoint_has_no_lm_head(tmp_path):
    model = _tiny_llama(tie=True)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    names = {name for name, _ in ckpt.weights(torch.float32)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert ckpt.hf_config["tie_word_embeddings"] is True


def test_config_and_generation_config(single_dir):
    ckpt = load_checkpoint(str(single_dir))
    cfg = ckpt.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_theta"] == 50000.0 and cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert (cfg["head_dim"], cfg["num_key_value_heads"]) == (8, 2)
    assert ckpt.generation_config["eos_token_id"] == [2, 7]
    assert ckpt.generation_config["temperature"] == 0.6


def test_transformers4_spelling_gets_both_spellings(single_dir, tmp_path):
    path = _copy(single_dir, tmp_path / "v4")
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=1234.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    (path / "config.json").write_text(json.dumps(raw))
    cfg = load_checkpoint(str(path)).hf_config
    assert cfg["rope_theta"] == 1234.0 and cfg["rope_parameters"]["rope_theta"] == 1234.0
    assert cfg["rope_parameters"]["rope_type"] == "linear"
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_no_generation_config_is_empty(sharded_dir, tmp_path):
    path = _copy(sharded_dir, tmp_path / "m")
    (path / "generation_config.json").unlink(missing_ok=True)
    assert load_checkpoint(str(path)).generation_config == {}


# --- broken folders ---------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist.*local Hugging Face folder"):
        load_checkpoint("/nonexistent/model")


def test_missing_config(single_dir, tmp_path):
    path = _copy(single_dir, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_checkpoint(str(path))


def test_corrupt_config(single_dir, tmp_path):
    path = _copy(single_dir, tmp_path / "m")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        load_checkpoint(str(path))


def test_no_safetensors(single_dir, tmp_path):
    path = _copy(single_dir, tmp_path / "m")
    (path / SINGLE_FILE).rename(path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no model.safetensors.*found: pytorch_model.bin"):
        load_checkpoint(str(path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(single_dir, tmp_path, damage):
    path = _copy(single_dir, tmp_path / "m")
    file = path / SINGLE_FILE
    data = file.read_bytes()
    file.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file.*save it again"):
        load_checkpoint(str(path))


def test_shard_listed_but_missing(sharded_dir, tmp_path):
    path = _copy(sharded_dir, tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"not there: {shard.name}"):
        load_checkpoint(str(path))


def test_index_and_shards_disagree(sharded_dir, tmp_path):
    path = _copy(sharded_dir, tmp_path / "m")
    index = json.loads((path / INDEX_FILE).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    index["weight_map"][name] = other
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=f"{other} does not contain 1 tensor"):
        load_checkpoint(str(path))


def test_checkpoint_without_source_says_how_to_build_one():
    from tokenmill.loader import Checkpoint

    ckpt = Checkpoint(path="x", format="hf", hf_config={}, generation_config={})
    with pytest.raises(ModelLoadError, match="load_checkpoint"):
        next(ckpt.weights(torch.float32))
