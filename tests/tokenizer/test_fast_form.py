"""``hf_folder.save_fast``: a saved tokenizer is rewritten to the generic class, its special
added tokens listed and tokenizer.json in ``fast_json``'s spelling, only when it loads back
equal, and then loads without transformers parsing tokenizer.json in Python; a form that
differs is put back as ``save_pretrained`` wrote it."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from tokenmill.tokenizer import fast_json, hf_folder

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
    listed = {t["content"] for t in config["added_tokens_decoder"].values()}
    assert listed == set(hf.all_special_tokens) & {str(t) for t in hf.added_tokens_decoder.values()}
    parsed = _json_loads_of(monkeypatch, "tokenizer.json")
    again = hf_folder.load_hf_folder(folder)
    assert parsed == []  # only the Rust parse of tokenizer.json
    text = (folder / "tokenizer.json").read_text()
    assert "\n" not in text[:1000]  # compact
    merges = json.loads(text)["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)  # "a b", not ["a", "b"]
    assert again.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
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
    for name in ("tokenizer_config.json", "tokenizer.json"):
        assert (folder / name).read_text() == (plain / name).read_text()


def test_differences_sees_another_tokenizer(smollm2_tok, tiny_tok):
    found = hf_folder.differences(smollm2_tok.hf, tiny_tok.hf)
    assert found and any(f.startswith("len") or f.startswith("encode") for f in found)
    assert hf_folder.differences(smollm2_tok.hf, smollm2_tok.hf) == []


def _spaced_merges_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE whose merges hold a space (no pre-tokenizer splits on it): "a" + " " -> "a "."""
    vocab = {"a": 0, "b": 1, " ": 2, "a ": 3, "a b": 4}
    bpe = models.BPE(vocab, [("a", " "), ("a ", "b")])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe))


def test_merges_with_a_space_keep_their_pairs(tmp_path):
    hf = _spaced_merges_tokenizer()
    assert hf.encode("a b") == [4]
    merges = [["a", " "], ["a ", "b"]]
    assert fast_json.merges_as_strings(merges) == merges
    assert fast_json.merges_as_strings([["a", "b"], ["ab", "c"]]) == ["a b", "ab c"]
    assert hf_folder.save_fast(hf, tmp_path / "tok")
    saved = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert saved["model"]["merges"] == merges


def test_merges_split_wrongly_are_not_kept(tmp_path, monkeypatch):
    """The string spelling forced on merges that hold a space loads another tokenizer (or
    none): save_fast sees it and keeps what save_pretrained wrote."""
    hf = _spaced_merges_tokenizer()
    monkeypatch.setattr(fast_json, "merges_as_strings", lambda m: [f"{a} {b}" for a, b in m])
    assert not hf_folder.save_fast(hf, tmp_path / "tok")
    saved = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert saved["model"]["merges"] == [["a", " "], ["a ", "b"]]
    assert hf_folder.load_hf_folder(tmp_path / "tok").encode("a b") == [4]


def test_differences_sees_a_pipeline_change_the_probes_miss(smollm2_tok, tmp_path):
    folder = tmp_path / "tok"
    smollm2_tok.hf.save_pretrained(str(folder))
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-1]  # a merge no probe text uses
    (folder / "tokenizer.json").write_text(json.dumps(data))
    found = hf_folder.differences(smollm2_tok.hf, hf_folder.load_hf_folder(folder))
    assert found == ["the tokenizers pipeline (its JSON as the library writes it back)"]


def test_gemma3_fast_form_equals_its_plain_folder(gemma_tok, tmp_path):
    """The folder as ``save_pretrained`` writes it, loaded the slow way (AutoTokenizer:
    GemmaTokenizer rebuilt in Python), and the fast form: the same tokenizer."""
    from transformers import AutoTokenizer

    plain_dir, fast_dir = tmp_path / "plain", tmp_path / "fast"
    gemma_tok.hf.save_pretrained(str(plain_dir))
    assert hf_folder.save_fast(gemma_tok.hf, fast_dir)
    plain = AutoTokenizer.from_pretrained(str(plain_dir))
    fast = hf_folder.load_hf_folder(fast_dir)
    assert hf_folder.differences(plain, fast) == []
    for text in MORE_TEXTS:
        assert fast.encode(text) == plain.encode(text)
