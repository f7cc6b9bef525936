"""Text <-> token ids: the Tokenizer wrapper, GGUF tokenizer conversion (cached), streaming
detokenization."""

from __future__ import annotations

from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
