"""Tiny random encoders with MiniLM's tokenizer, for the pooling tests (a module of its
own: ``from conftest import`` would resolve to whichever folder's conftest came first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


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
