"""Whisper's shape, read from an HF ``config.json`` or inferred from CTranslate2 tensors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WhisperConfig:
    d_model: int = 384
    """Hidden size of the encoder and the decoder."""
    heads: int = 6
    """Attention heads (encoder and decoder alike)."""
    encoder_layers: int = 4
    decoder_layers: int = 4
    ffn: int = 1536
    """Hidden size of each feed-forward block."""
    n_mels: int = 80
    """Mel bins of the input features (128 for large-v3)."""
    vocab_size: int = 51864
    max_source_positions: int = 1500
    """Encoder positions: 3000 mel frames after the stride-2 convolution."""
    max_target_positions: int = 448
    """Decoder context in tokens (prompt + generated)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def multilingual(self) -> bool:
        """Whisper's own rule: the English-only vocabularies are one token shorter."""
        return self.vocab_size >= 51865

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> WhisperConfig:
        return cls(
            d_model=cfg["d_model"],
            heads=cfg["encoder_attention_heads"],
            encoder_layers=cfg["encoder_layers"],
            decoder_layers=cfg["decoder_layers"],
            ffn=cfg["encoder_ffn_dim"],
            n_mels=cfg.get("num_mel_bins", 80),
            vocab_size=cfg["vocab_size"],
            max_source_positions=cfg.get("max_source_positions", 1500),
            max_target_positions=cfg.get("max_target_positions", 448),
        )

    @classmethod
    def from_ct2(cls, tensors: dict[str, torch.Tensor]) -> WhisperConfig:
        """From the tensors themselves (CTranslate2 stores no config of the shape)."""
        vocab, d_model = tensors["decoder/embeddings/weight"].shape

        def layers(side: str) -> int:
            return len({k.split("/")[1] for k in tensors if re.match(rf"{side}/layer_\d+/", k)})

        return cls(
            d_model=d_model,
            heads=int(tensors["encoder/num_heads"].item()),
            encoder_layers=layers("encoder"),
            decoder_layers=layers("decoder"),
            ffn=tensors["encoder/layer_0/ffn/linear_0/weight"].shape[0],
            n_mels=tensors["encoder/conv1/weight"].shape[1],
            vocab_size=vocab,
            max_source_positions=tensors["encoder/position_encodings/encodings"].shape[0],
            max_target_positions=tensors["decoder/position_encodings/encodings"].shape[0],
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF ``WhisperConfig`` dict of this shape (for converting a CT2 folder)."""
        return {
            "architectures": ["WhisperForConditionalGeneration"],
            "model_type": "whisper",
            "d_model": self.d_model,
            "encoder_attention_heads": self.heads,
            "decoder_attention_heads": self.heads,
            "encoder_layers": self.encoder_layers,
            "decoder_layers": self.decoder_layers,
            "encoder_ffn_dim": self.ffn,
            "decoder_ffn_dim": self.ffn,
            "num_mel_bins": self.n_mels,
            "vocab_size": self.vocab_size,
            "max_source_positions": self.max_source_positions,
            "max_target_positions": self.max_target_positions,
            "activation_function": "gelu",
            "scale_embedding": False,
            "tie_word_embeddings": True,
        }
