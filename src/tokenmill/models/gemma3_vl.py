"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP tower, the multimodal
projector, and our Gemma 3 text decoder (``gemma3.py``) as the language model.

image [3, S, S] -> SigLIP patches [(S/P)^2, width] (learned position per patch, no
bucketing: every image is resized to S x S) -> average pool to ``mm_tokens_per_image``
(k x k patches per token) -> (1 + w) RMSNorm ("soft embedding norm") -> one matmul into
the LM's width: one ``<image_soft_token>`` run per image (``multimodal/gemma3.py``).
The run's tokens attend to each other bidirectionally (``MultiModalInputs.bidirectional``).

Weights: transformers 5 saves ``language_model.model.*`` / ``vision_tower.*`` /
``multi_modal_projector.*``; the hub's checkpoints have ``vision_tower.vision_model.*``;
``model.`` in front of all of them also loads. The LM head is tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.smolvlm_vision import SiglipSpec, SiglipTower, load_vision_weight
from tokenmill.models.weights import load_weights
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import MultiModalInfo

_TOWER = ("vision_tower.vision_model.", "vision_tower.")
_PROJECTOR = "multi_modal_projector."
_LANGUAGE = ("language_model.model.", "language_model.")


class Gemma3VisionTower(SiglipTower):
    """images [n, 3, S, S] -> patch features [n, (S/P)^2, width]: SmolVLM's SigLIP layers,
    every patch at its own learned position (no padding, no NaViT bucketing)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        n, c, s, _ = images.shape
        p = self.spec.patch_size
        g = s // p
        # HF's stride = kernel Conv2d as a matmul over each (C, P, P) patch, row-major
        patches = images.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        emb = self.embeddings
        x = emb.patch_embedding(patches.reshape(n, g * g, c * p * p))
        x = x + emb.position_embedding.weight[None]
        layers: list[nn.Module] = list(self.encoder.layers)  # type: ignore[arg-type]
        for layer in layers:
            x = layer(x, None)
        return self.post_layernorm(x)


class _Weight(nn.Module):
    """A norm's scale under HF's name (``mm_soft_emb_norm.weight``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class Gemma3Projector(nn.Module):
    """patch features [n, side^2, width] -> [n, tokens, hidden]: k x k average pooling,
    (1 + w) RMSNorm in float32 as HF's Gemma3RMSNorm, one matmul (no bias)."""

    def __init__(self, spec: SiglipSpec, tokens: int, dtype: torch.dtype) -> None:
        super().__init__()
        device = torch.get_default_device()
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(spec.width, spec.out_dim, dtype=dtype, device=device)
        )
        self.mm_soft_emb_norm = _Weight(torch.empty(spec.width, dtype=dtype, device=device))
        self.eps = spec.eps
        self.side = spec.per_side
        out_side = int(tokens**0.5)
        if out_side * out_side != tokens or self.side % out_side:
            raise ModelLoadError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides the "
                f"{self.side} patches per side"
            )
        self.kernel = self.side // out_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, width = x.shape
        grid = x.transpose(1, 2).reshape(n, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = (h * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(h, self.mm_input_projection_weight).to(x.dtype)


class _Vision(nn.Module):
    def __init__(self, spec: SiglipSpec, tokens: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vision_tower = Gemma3VisionTower(spec, dtype)
        self.multi_modal_projector = Gemma3Projector(spec, tokens, dtype)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "gemma3_text")
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return text


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        max_positions: int | None = None,
        quant: Any = None,
        ops: Any = None,
    ) -> None:
        super().__init__(_text_config(hf_config), dtype, max_positions, quant, ops)
        tokens = int(hf_config.get("mm_tokens_per_image", 256))
        vision = {**(hf_config.get("vision_config") or {})}
        vision.setdefault("image_size", 896)
        vision.setdefault("patch_size", 14)
        spec = SiglipSpec.from_hf({"vision_config": vision}, self.config.hidden_size)
        self.vision = _Vision(spec, tokens, dtype)
        self.multimodal = MultiModalInfo(
            image_token_id=int(hf_config.get("image_token_index", 262144)),
            video_token_id=-1,
            merge_size=self.vision.multi_modal_projector.kernel,
            processor="gemma3",
            tile_tokens=tokens,
            start_token_id=int(hf_config.get("boi_token_index", 255999)),
            end_token_id=int(hf_config.get("eoi_token_index", 256000)),
        )

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Images [3, S, S] each -> their runs' embeddings [tokens, hidden] each."""
        device = self.vision.multi_modal_projector.mm_input_projection_weight.device
        images = torch.stack([it.pixel_values for it in items]).to(device, self.dtype)
        out = self.vision.multi_modal_projector(self.vision.vision_tower(images))
        return list(out.unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tower and projector tensors load into ``vision`` as they stream by; the rest are
        the decoder's (``lm_head`` is tied to the embedding: skipped)."""
        # checked here, not when built: a parallel rank is built at its shard's vocabulary
        if self.multimodal.image_token_id >= self.vocab_size:
            raise ModelLoadError(
                f"image_token_index={self.multimodal.image_token_id} is outside the "
                f"vocabulary ({self.vocab_size} tokens)"
            )
        vision: set[str] = set()

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                ours = _vision_name(name)
                if ours is not None:
                    load_vision_weight(self.vision, ours, tensor)
                    vision.add(ours)
                    continue
                if name.endswith("lm_head.weight"):
                    continue  # tied to the embedding
                for prefix in _LANGUAGE:
                    if name.startswith(prefix):
                        name = "model." + name[len(prefix) :]
                        break
                yield name, tensor

        text = nn.Module()  # the decoder's parameters only
        text.model = self.model
        loaded = load_weights(text, text_only())
        if self.vision is None:  # a parallel rank that never encodes
            return loaded
        missing = sorted(dict(self.vision.named_parameters()).keys() - vision)
        if missing:
            raise ModelLoadError(f"checkpoint is missing vision weights: {', '.join(missing)}")
        return loaded | vision


def _vision_name(name: str) -> str | None:
    """A tower or projector tensor's name in ``_Vision``; None for the decoder's."""
    for prefix in _TOWER:
        if name.startswith(prefix):
            return "vision_tower." + name[len(prefix) :]
    if name.startswith(_PROJECTOR):
        return name
    return None
