"""Qwen2-Audio: a Whisper-style audio encoder (conv stem, pre-norm layers, 2x average
pooling) and a linear projector in front of Qwen2's decoder.

One media item is one 30 s window of 128-bin log-mel features [128, 3000] with its valid
frame count (``multimodal/audio.py`` cuts longer audio into windows, never truncates):
padded frames are masked as keys, the pooled output is cut to the window's
((L - 1) // 2 + 1 - 2) // 2 + 1 tokens. Weights: ``language_model.*`` for the decoder,
``audio_tower.*`` and ``multi_modal_projector.*`` for the rest (HF names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.config import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM, DecoderSpec
from tokenmill.models.qwen2_vl_vision import _linear
from tokenmill.models.weights import load_weights
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.v_proj, self.out_proj = (_linear(d, d, dtype) for _ in range(3))
        self.k_proj = _linear(d, d, dtype, bias=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        n, length, d = x.shape
        scale = (d // self.heads) ** -0.5
        q = (
            (self.q_proj(x) * scale).view(n, length, self.heads, -1).transpose(1, 2)
        )  # HF scales q first
        k, v = (
            p(x).view(n, length, self.heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, d))


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.self_attn = _Attention(d, heads, dtype)
        self.final_layer_norm = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = _linear(d, ffn, dtype)
        self.fc2 = _linear(ffn, d, dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """mel [n, 128, 3000] + valid frames [n] -> pooled features [n, 750, d]."""

    def __init__(self, a: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        d, mels = int(a.get("d_model", 1280)), int(a.get("num_mel_bins", 128))
        self.conv1 = nn.Conv1d(mels, d, 3, padding=1, dtype=dtype)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = nn.Embedding(
            int(a.get("max_source_positions", 1500)), d, dtype=dtype
        )
        heads, ffn = int(a.get("encoder_attention_heads", 20)), int(a.get("encoder_ffn_dim", 5120))
        self.layers = nn.ModuleList(
            _Layer(d, heads, ffn, dtype) for _ in range(int(a.get("encoder_layers", 32)))
        )
        self.layer_norm = nn.LayerNorm(d, dtype=dtype)

    def forward(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)  # [n, 1500, d]
        x = x + self.embed_positions.weight
        valid = (frames - 1) // 2 + 1  # frames after the stride-2 conv
        keys = torch.arange(x.shape[1], device=x.device)[None, :] < valid[:, None]
        key_mask = None if bool(keys.all()) else keys[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


class Qwen2AudioForConditionalGeneration(DecoderForCausalLM):
    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, max_positions: int | None = None,
                 quant: Any = None, ops: Any = None) -> None:  # fmt: skip
        text = dict(hf_config.get("text_config") or {})
        text.setdefault("model_type", "qwen2")
        super().__init__(text, dtype, max_positions, quant, ops)
        self.audio_tower = AudioEncoder(hf_config.get("audio_config") or {}, dtype)
        d = self.audio_tower.layer_norm.normalized_shape[0]
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = _linear(d, self.config.hidden_size, dtype)
        token = hf_config.get("audio_token_index", hf_config.get("audio_token_id", 151646))
        self.multimodal = MultiModalInfo(
            image_token_id=-1, video_token_id=-1, merge_size=1, processor="qwen2_audio",
            audio_token_id=int(token),
        )  # fmt: skip

    @classmethod
    def decoder_spec(cls, cfg: ArchConfig) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """30 s windows -> their placeholder embeddings [tokens, hidden] each."""
        device = self.audio_tower.conv1.weight.device
        mel = torch.stack([it.pixel_values for it in items]).to(device, self.dtype)
        frames = torch.tensor([it.grid_thw[2] for it in items], device=device)
        proj: nn.Linear = self.multi_modal_projector.linear  # type: ignore[assignment]
        out = proj(self.audio_tower(mel, frames)).to(self.dtype)
        return [o[: it.num_tokens] for o, it in zip(out, items)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        audio: dict[str, nn.Parameter] = {}
        if self.audio_tower is not None:  # None: a parallel rank that never encodes
            audio.update(self.audio_tower.named_parameters(prefix="audio_tower"))
            projector = self.multi_modal_projector.named_parameters(prefix="multi_modal_projector")
            audio.update(projector)
        seen: set[str] = set()

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in audio:
                    if audio[name].shape != tensor.shape:
                        raise ModelLoadError(
                            f"{name!r}: shape {tuple(tensor.shape)} != {tuple(audio[name].shape)}"
                        )
                    with torch.no_grad():
                        audio[name].copy_(tensor)
                    seen.add(name)
                elif name.startswith("language_model."):
                    yield name[len("language_model.") :], tensor
                else:
                    raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")

        text = nn.Module()
        text.model = self.model
        if self.lm_head is not None:
            text.lm_head = self.lm_head
        skip = ("lm_head.weight",) if self.lm_head is None else ()
        loaded = load_weights(text, text_only(), skip=skip)
        missing = sorted(audio.keys() - seen)
        if missing:
            raise ModelLoadError(f"checkpoint is missing audio weights: {', '.join(missing)}")
        return loaded | seen
