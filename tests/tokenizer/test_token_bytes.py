"""token_bytes: the bytes of a text's tokens concatenate back to the text's UTF-8 bytes."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidRequestError
from tokenmill.tokenizer.token_bytes import gpt2_byte_decoder, sentencepiece_bytes

TEXT = "Naïve café 🤗 日本語\n\ttab  two spaces <b>"


def test_gpt2_table_is_transformers_table():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gpt2_byte_decoder() == {char: byte for byte, char in bytes_to_unicode().items()}


def test_byte_level_tokens_concatenate_to_the_text(smollm2_tok):
    ids = smollm2_tok.encode(TEXT)
    assert b"".join(smollm2_tok.token_bytes(i) for i in ids) == TEXT.encode()
    partial = [smollm2_tok.token_bytes(i) for i in smollm2_tok.encode("🤗")]
    assert len(partial) > 1  # the emoji is split inside its UTF-8 bytes
    assert smollm2_tok.token_bytes(2) == b"<|im_end|>"


def test_sentencepiece_tokens_concatenate_to_the_text(tiny_tok, gemma_tok):
    tiny_ids = tiny_tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tiny_tok.token_bytes(i) for i in tiny_ids) == b" " + TEXT.encode()  # "▁" prefix
    gemma_ids = gemma_tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(gemma_tok.token_bytes(i) for i in gemma_ids) == TEXT.encode()


def test_sentencepiece_spelling():
    assert sentencepiece_bytes("\u2581Hello") == b" Hello"
    assert sentencepiece_bytes("<0x0A>") == b"\n"
    assert sentencepiece_bytes("<0xF0>") == b"\xf0"
    assert sentencepiece_bytes("<s>") == b"<s>"


def test_out_of_range_id(smollm2_tok):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        smollm2_tok.token_bytes(smollm2_tok.vocab_size)
