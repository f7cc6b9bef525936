"""IncrementalDetokenizer: token by token, the deltas add up to the full decode, and no
delta ever carries half a character."""

from __future__ import annotations

import pytest

from tokenmill.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, plain ASCII.",
    "emoji 🤗🚀 family 👩‍👩‍👧 flags 🇫🇷!",
    "中文和日本語のテキスト、한국어도",
    "Accents: naïve café, Ærøskøbing, Ünïcödé ñ",
    "mixed: x² ≤ ∑ 🤗 日本 é",
]


def _stream(tok, ids, prompt_ids=(), skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, list(prompt_ids), skip_special_tokens)
    deltas = [detok.append([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.output_text
    return deltas


@pytest.mark.parametrize("name", ["smollm2_tok", "tiny_tok", "gemma_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(request, name, text):
    tok = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context_byte_level_equals_full_decode(smollm2_tok, text):
    prompt = smollm2_tok.apply_chat_template([{"role": "user", "content": "Say it"}])
    ids = smollm2_tok.encode(text, add_special_tokens=False)
    deltas = _stream(smollm2_tok, ids, prompt)
    assert "".join(deltas) == smollm2_tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt(tiny_tok):
    prompt = tiny_tok.encode("The capital of France is")
    ids = tiny_tok.encode(" Paris, of course.", add_special_tokens=False)
    assert tiny_tok.decode(ids) == "Paris, of course."  # the decoder strips the leading space
    assert "".join(_stream(tiny_tok, ids, prompt)) == " Paris, of course."


def test_partial_character_is_held_until_completed(smollm2_tok):
    ids = smollm2_tok.encode("🤗", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tok, [])
    assert [detok.append([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.append(ids[-1:]) == "🤗"
    assert detok.flush() == ""


def test_flush_emits_an_unfinished_character(smollm2_tok):
    ids = smollm2_tok.encode("ok 🤗", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tok, [])
    held = "".join(detok.append([i]) for i in ids[:-1])
    assert held == "ok" and "\ufffd" not in held
    tail = detok.flush()
    assert tail.startswith(" ") and tail.endswith("\ufffd")
    assert detok.output_text == smollm2_tok.decode(ids[:-1])


def test_several_tokens_per_append(gemma_tok):
    ids = gemma_tok.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(gemma_tok, [])
    text = "".join(detok.append(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == TEXTS[1]


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(smollm2_tok, skip):
    ids = smollm2_tok.encode("Done.", add_special_tokens=False) + [2]  # <|im_end|>
    text = "".join(_stream(smollm2_tok, ids, skip_special_tokens=skip))
    assert text == ("Done." if skip else "Done.<|im_end|>")
