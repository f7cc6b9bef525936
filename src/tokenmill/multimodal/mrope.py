"""Qwen-VL multimodal rotary positions (M-RoPE), worked out once per prompt.

Text tokens advance one position on all three axes (time, height, width); an image's
placeholder run of t x h x w merged tokens takes positions start + (t * interval, row,
column), and the text after it continues at start + max(h, w) (transformers 5.x's rule).
A generated token at index i has position i + delta on every axis.
"""

from __future__ import annotations

import torch

from tokenmill.multimodal.inputs import MediaItem, PlaceholderRange


def vision_positions(start: int, item: MediaItem, merge: int) -> torch.Tensor:
    """[3, t * h' * w'] positions of one item's merged tokens."""
    t, h, w = item.grid_thw
    h, w = h // merge, w // merge
    tt = (torch.arange(t) * item.time_interval).long() + start
    hh = torch.arange(h) + start
    ww = torch.arange(w) + start
    grid = torch.stack(torch.meshgrid(tt, hh, ww, indexing="ij"))  # [3, t, h, w]
    return grid.reshape(3, -1)


def mrope_positions(
    prompt_len: int,
    items: tuple[MediaItem, ...],
    ranges: tuple[PlaceholderRange, ...],
    merge: int,
) -> tuple[torch.Tensor, int]:
    """([3, prompt_len] int64 positions, delta for the tokens after the prompt)."""
    parts: list[torch.Tensor] = []
    pos = index = 0
    for item, r in zip(items, ranges):
        text = r.offset - index
        parts.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        block = vision_positions(pos, item, merge)
        assert block.shape[1] == r.length, "placeholder run and grid disagree"
        parts.append(block)
        _, h, w = item.grid_thw
        pos += max(h, w) // merge
        index = r.end
    parts.append(torch.arange(prompt_len - index).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - prompt_len
