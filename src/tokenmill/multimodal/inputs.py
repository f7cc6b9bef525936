"""What a processed media item and a request's media look like past the boundary."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaItem:
    """One processed image (or video), ready for the encoder."""

    modality: str
    """"image" or "video"."""
    content_hash: bytes
    """SHA-256 of the processed tensors and the grid (``hashing.py``): the encoder cache
    and the prefix cache key on it."""
    pixel_values: torch.Tensor
    """[patches, patch_dim] float32, the processor's patch order."""
    grid_thw: tuple[int, int, int]
    """Patches along time, height, width."""
    num_tokens: int
    """Placeholder tokens in the prompt = encoder output rows."""
    time_interval: float = 1.0
    """M-RoPE temporal step per frame group (videos: tokens_per_second * seconds)."""
    pixel_mask: torch.Tensor | None = None
    """[S, S] bool: the valid pixels of a padded square tile (Idefics3 / SmolVLM)."""


@dataclass(frozen=True)
class PlaceholderRange:
    """Prompt tokens [offset, offset + length) are item ``index``'s embeddings."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalInputs:
    """A request's media, in prompt order, and what its positions are (M-RoPE)."""

    items: tuple[MediaItem, ...]
    ranges: tuple[PlaceholderRange, ...]
    """One per item, ascending, disjoint."""
    mrope_positions: torch.Tensor | None = None
    """[3, prompt_len] int64 (Qwen-VL's M-RoPE); None for 1-D rotary models."""
    mrope_delta: int = 0
    """Position of a token at index i >= prompt_len: i + delta (on all three axes)."""
    preprocess_seconds: float = 0.0
    """Time spent decoding and processing the media (metrics)."""
    bidirectional: bool = False
    """Each run's tokens attend to each other, later ones too (Gemma 3's images): the
    scheduler never ends a prefill chunk inside a run (``encoder_budget.whole_runs``) and
    the runner hands the runs a chunk holds to attention as bidirectional spans."""

    def overlapping(self, start: int, end: int) -> list[int]:
        """Items whose placeholders intersect tokens [start, end)."""
        return [i for i, r in enumerate(self.ranges) if r.offset < end and r.end > start]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of tokens [start, end)."""
        assert self.mrope_positions is not None
        prompt_len = self.mrope_positions.shape[1]
        head = self.mrope_positions[:, start : min(end, prompt_len)]
        if end <= prompt_len:
            return head
        tail = torch.arange(max(start, prompt_len), end) + self.mrope_delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)
