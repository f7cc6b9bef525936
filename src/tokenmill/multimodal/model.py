"""What a model with a media encoder tells the rest of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tokenmill.multimodal.inputs import MediaItem


@dataclass(frozen=True)
class MultiModalInfo:
    """A multimodal model's placeholder tokens and position rule."""

    image_token_id: int
    video_token_id: int
    merge_size: int
    """Patches per merged token along each side (Qwen-VL: 2)."""
    tokens_per_second: float = 2.0
    """Video: M-RoPE temporal positions per second."""
    uses_mrope: bool = False
    """Positions are [3, T] (Qwen-VL) for requests with media."""
    processor: str = "qwen_vl"
    """Which boundary processor (``prompt.PROCESSORS``) turns media into placeholder runs."""
    tile_tokens: int = 0
    """Idefics3 / SmolVLM: placeholder tokens per image tile."""
    audio_token_id: int = -1
    """Qwen2-Audio's ``<|AUDIO|>`` placeholder (-1: no audio)."""
    start_token_id: int = -1
    """Gemma 3: ``<start_of_image>``, what a prompt marks each image with; Qwen3-VL:
    ``<|vision_start|>``, opening each video frame pair's segment (-1: none)."""
    end_token_id: int = -1
    """Gemma 3: ``<end_of_image>``; Qwen3-VL: ``<|vision_end|>``."""
    deepstack_layers: int = 0
    """Qwen3-VL: each encoder row also carries this many DeepStack features after its
    embedding ([(1 + L) * hidden]); the step hands them over as ``InputEmbeds.deepstack``."""


@runtime_checkable
class SupportsMultiModal(Protocol):
    multimodal: MultiModalInfo

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Processed items -> their placeholder embeddings [num_tokens, hidden] each."""
        ...


def multimodal_info(model: object) -> MultiModalInfo | None:
    """The model's ``MultiModalInfo``, or None for a text-only model."""
    info = getattr(model, "multimodal", None)
    return info if isinstance(info, MultiModalInfo) else None
