"""A folder whose tokenizer is transformers' generic fast class is built directly (no
AutoTokenizer lookup): the same tokenizer as AutoTokenizer gives; other classes still go
through AutoTokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tokenmill.loader import load_checkpoint
from tokenmill.tokenizer import hf_folder, load_tokenizer

TEXTS = ["Hello world", " The capital of France is", "Ünïcode 日本語 🎉", "a\n\n  b\tc", ""]


@pytest.mark.parametrize(
    ("tok", "gguf"), [("smollm2_tok", "smollm2_gguf"), ("tiny_tok", "tinycoder_gguf")]
)
def test_generic_folder_loads_directly_and_equals_auto(tok, gguf, request, tmp_path, monkeypatch):
    ours = request.getfixturevalue(tok)
    folder = tmp_path / "tok"
    ours.hf.save_pretrained(str(folder))
    assert hf_folder.generic_class(folder)
    auto = AutoTokenizer.from_pretrained(str(folder))
    looked_up: list[str] = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: looked_up.append("auto") or real(*a, **k))  # fmt: skip
    ckpt = load_checkpoint(str(request.getfixturevalue(gguf)))
    direct = load_tokenizer(ckpt, str(folder))
    assert looked_up == []
    assert type(direct.hf) is type(auto)
    assert (direct.vocab_size, direct.bos_token_id) == (len(auto), auto.bos_token_id)
    assert direct.hf.eos_token_id == auto.eos_token_id
    assert direct.chat_template == ours.chat_template
    for text in TEXTS:
        ids = auto.encode(text)
        assert direct.encode(text) == ids == ours.encode(text)
        assert direct.decode(ids, skip_special_tokens=False) == auto.decode(ids)


def test_other_classes_go_through_auto(smollm2_tok, tmp_path):
    folder = tmp_path / "tok"
    smollm2_tok.hf.save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert not hf_folder.generic_class(folder)
    (folder / "tokenizer_config.json").unlink()
    assert not hf_folder.generic_class(folder)
