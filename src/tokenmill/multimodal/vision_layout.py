"""Where each patch of a Qwen-VL image batch sits: rotary positions, attention segments.

Host-side integer work, done once per encoder call from the grids (t, h, w in patches).
The processor emits patches merge-block-major (each 2 x 2 block of neighbours is four
consecutive rows), and so does everything here.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class VisionLayout:
    hw_positions: torch.Tensor
    """[N, 2] int64: each patch's (row, column) in its frame."""
    frame_bounds: tuple[int, ...]
    """Segment bounds of full attention: one segment per frame of every image."""
    window_order: torch.Tensor | None
    """[N / unit] merge-block permutation into window order (None: no windows)."""
    window_bounds: tuple[int, ...] | None
    """Segment bounds of windowed attention, over the permuted rows."""


def hw_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2]: (row, col) of every patch, merge-block-major, repeated per frame."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_bounds(grid_thw: list[tuple[int, int, int]]) -> tuple[int, ...]:
    sizes = [h * w for t, h, w in grid_thw for _ in range(t)]
    return tuple(accumulate(sizes, initial=0))


def window_index(
    grid_thw: list[tuple[int, int, int]], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(merge-block order by window, window bounds in patch rows). Windows tile each frame
    in squares of ``window_size // merge // patch_size`` merged tokens (the last row and
    column of windows may be smaller); empty windows are dropped."""
    side = window_size // merge // patch_size
    unit = merge * merge
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    base = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % side, -gw % side
        padded = torch.nn.functional.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = (
            padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        )
        keep = windows >= 0
        order.append(windows[keep] + base)
        sizes += [n * unit for n in keep.sum(-1).tolist() if n]
        base += t * gh * gw
    return torch.cat(order), tuple(accumulate(sizes, initial=0))


def vision_layout(
    grid_thw: list[tuple[int, int, int]], merge: int, window_size: int | None, patch_size: int
) -> VisionLayout:
    windows, bounds = (None, None)
    if window_size is not None:
        windows, bounds = window_index(grid_thw, merge, window_size, patch_size)
    return VisionLayout(hw_positions(grid_thw, merge), frame_bounds(grid_thw), windows, bounds)
