"""``hf_folder.save_fast``: a saved tokenizer is rewritten to the generic class with its added
tokens listed only when it loads back equal, and then loads without transformers parsing
tokenizer.json in Python; a form that differs is put back as ``save_pretrained`` wrote it."""

from __future__ import annotations

import json

import pytest

from tokenmill.tokenizer import hf_folder

MORE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ĝis revido! Ça va? Straße, naïve café",
    "\n\n\n   \t  ",
    "http://example.com/a?b=c&d=e#f",
    "<<>>[[]]{{}}((  ))",
]


def _json_loads_of(monkeypatch, name: str) -> list[str]:
    """Files named ``name`` that Python's json.load reads from now on."""
    seen: list[str] = []
    real = json.load
    monkeypatch.setattr(json, "load", lambda f, *a, **k: (
        seen.append(f.name) if str(getattr(f, "name", "")).endswith(name) else None,
        real(f, *a, **k))[1])  # fmt: skip
    return seen


@pytest.mark.parametrize("tok", ["smollm2_tok", "tiny_tok", "gemma_tok"])
def test_fast_form_loads_back_equal_without_python_parse(tok, request, tmp_path, monkeypatch):
    hf = request.getfixturevalue(tok).hf
    folder = tmp_path / "tok"
    assert hf_folder.save_fast(hf, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"
    assert len(config["added_tokens_decoder"]) == len(hf.added_tokens_decoder)
    parsed = _json_loads_of(monkeypatch, "tokenizer.json")
    again = hf_folder.load_hf_folder(folder)
    assert parsed == []  # only the Rust parse of tokenizer.json
    assert hf_folder.differences(hf, again) == []
    for text in MORE_TEXTS:
        ids = hf.encode(text)
        assert again.encode(text) == ids
        assert again.decode(ids, skip_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False
        )


def test_a_form_that_differs_is_put_back(smollm2_tok, tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    smollm2_tok.hf.save_pretrained(str(plain))
    monkeypatch.setattr(hf_folder, "differences", lambda a, b: ["encode('x')"])
    folder = tmp_path / "tok"
    assert not hf_folder.save_fast(smollm2_tok.hf, folder)
    assert (folder / "tokenizer_config.json").read_text() == (
        plain / "tokenizer_config.json"
    ).read_text()


def test_differences_sees_another_tokenizer(smollm2_tok, tiny_tok):
    found = hf_folder.differences(smollm2_tok.hf, tiny_tok.hf)
    assert found and any(f.startswith("len") or f.startswith("encode") for f in found)
    assert hf_folder.differences(smollm2_tok.hf, smollm2_tok.hf) == []
