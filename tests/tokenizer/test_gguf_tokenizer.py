"""GGUF tokenizers: same ids as transformers' own conversion, cached, BOS as the model wants."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest

from tokenmill.loader import load_checkpoint
from tokenmill.tokenizer import gguf_tokenizer, load_tokenizer
from tokenmill.tokenizer.gguf_tokenizer import cache_path

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "naïve café, Ærøskøbing, Ünïcödé",
    "日本語のテキスト and 中文 mixed",
    "emoji 🤗🚀👩‍👩‍👧 and symbols ∑∫√",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers_gguf_tokenizer(smollm2_tok, smollm2_hf_tokenizer, text):
    ids = smollm2_tok.encode(text)
    assert ids == smollm2_hf_tokenizer.encode(text)
    assert smollm2_tok.decode(ids) == smollm2_hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert smollm2_tok.decode(ids, skip_special_tokens=False) == text


def test_smollm2_properties(smollm2_tok):
    assert smollm2_tok.vocab_size == 49152
    assert smollm2_tok.eos_token_ids == {2}
    assert smollm2_tok.encode("Hi")[0] != smollm2_tok.bos_token_id  # add_bos_token is false
    assert "<|im_start|>" in smollm2_tok.chat_template


def test_second_load_is_a_fast_cache_hit(smollm2_tok, smollm2_gguf, tokenizer_cache, monkeypatch):
    assert (cache_path(smollm2_gguf) / "tokenizer.json").is_file()
    assert cache_path(smollm2_gguf).is_relative_to(tokenizer_cache / "tokenizers")

    def no_conversion(path):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(gguf_tokenizer, "convert_gguf_tokenizer", no_conversion)
    ckpt = load_checkpoint(str(smollm2_gguf))
    start = time.perf_counter()
    again = load_tokenizer(ckpt)
    assert time.perf_counter() - start < 1.5  # ~0.2 s on two cores
    for text in TEXTS:
        assert again.encode(text) == smollm2_tok.encode(text)
    assert again.chat_template == smollm2_tok.chat_template
    assert again.eos_token_ids == smollm2_tok.eos_token_ids


def test_cached_sentencepiece_tokenizer_behaves_the_same(tiny_tok, tinycoder_gguf, monkeypatch):
    monkeypatch.setattr(gguf_tokenizer, "convert_gguf_tokenizer", None)  # must not be called
    cached = load_tokenizer(load_checkpoint(str(tinycoder_gguf)))
    for text in TEXTS:
        ids = tiny_tok.encode(text)
        assert cached.encode(text) == ids and ids[0] == 1
        assert cached.decode(ids) == tiny_tok.decode(ids)


def test_cache_key_follows_the_file(tinycoder_gguf, tmp_path):
    copy = tmp_path / "tiny.gguf"
    shutil.copy(tinycoder_gguf, copy)
    before = cache_path(copy)
    os.utime(copy, ns=(0, 12345))
    assert cache_path(copy) != before
    assert cache_path(copy) != cache_path(tinycoder_gguf)


def test_damaged_cache_entry_is_rebuilt(tiny_tok, tinycoder_gguf):
    entry = cache_path(tinycoder_gguf)
    (entry / "tokenizer.json").write_text("{broken")
    again = load_tokenizer(load_checkpoint(str(tinycoder_gguf)))
    assert again.encode("Hello") == tiny_tok.encode("Hello")
    assert json.loads((entry / "tokenizer.json").read_text())["model"]  # rewritten whole


def test_unwritable_cache_still_loads(tinycoder_gguf, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker / "cache"))
    tok = load_tokenizer(load_checkpoint(str(tinycoder_gguf)))
    assert tok.encode("Hello")[0] == 1
    assert "TOKENMILL_CACHE_DIR" in caplog.text


def test_eos_ids_merge_generation_config_and_config(smollm2_gguf, smollm2_tok):
    ckpt = load_checkpoint(str(smollm2_gguf))
    ckpt = dataclasses.replace(
        ckpt, generation_config={"eos_token_id": [2, 5]}, hf_config={"eos_token_id": 0}
    )
    assert load_tokenizer(ckpt).eos_token_ids == {0, 2, 5}


def test_tinycoder_sentencepiece_adds_bos(tiny_tok):
    ids = tiny_tok.encode("Hello world")
    assert ids[0] == tiny_tok.bos_token_id == 1
    assert tiny_tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert tiny_tok.decode(ids) == "Hello world"
    assert tiny_tok.chat_template is None


def test_gemma_adds_bos_and_has_no_template(gemma_tok):
    ids = gemma_tok.encode("Hello world")
    assert ids[0] == gemma_tok.bos_token_id == 2
    assert ids.count(2) == 1
    assert gemma_tok.encode("Hello world", add_special_tokens=False) == ids[1:]
    assert gemma_tok.decode(ids) == "Hello world"
    assert gemma_tok.eos_token_ids == {1}
    assert gemma_tok.chat_template is None and gemma_tok.vocab_size == 262144


def test_tokenizer_override_folder(smollm2_tok, smollm2_gguf, tmp_path):
    smollm2_tok.hf.save_pretrained(tmp_path)
    tok = load_tokenizer(load_checkpoint(str(smollm2_gguf)), tokenizer=str(tmp_path))
    assert tok.encode("naïve café") == smollm2_tok.encode("naïve café")


def test_bad_tokenizer_paths(smollm2_gguf, tmp_path):
    from tokenmill.errors import ModelLoadError

    ckpt = load_checkpoint(str(smollm2_gguf))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(ckpt, tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no usable tokenizer in"):
        load_tokenizer(ckpt, tokenizer=str(tmp_path))
