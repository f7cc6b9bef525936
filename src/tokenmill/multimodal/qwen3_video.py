"""Qwen3-VL video without torchvision: frames, timestamps, one item per frame pair.

transformers' Qwen3VLVideoProcessor needs torchvision (not usable with this torch); this
follows its rules: ``sample_frames`` (``fps`` frames per second of the video, default 2, or
``nframes``; at least ``min_frames``, at most ``max_frames`` and the video's own;
``linspace`` indices rounded), its ``smart_resize`` over all sampled frames (sides
multiples of patch x merge, the frames' total pixels within [shortest_edge,
longest_edge]), each frame resized with PIL bicubic and normalized as the image processor
does a picture (transformers resizes with torchvision's bicubic: close, not bit-equal),
frames paired along time (the last repeated). Each pair becomes its own prompt segment as
transformers' processor writes it, ``<{t:.1f} seconds><|vision_start|>`` + its
``<|video_pad|>`` run + ``<|vision_end|>`` with t the pair's mean timestamp, and its own
media item (grid (1, h, w)): the tower attends per frame anyway, and M-RoPE places each
pair like an image, as transformers splits the video's grid per frame.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.video import (
    DEFAULT_FPS,
    VideoConfig,
    VideoOptions,
    _frame,
    num_pairs,
    pair_over_budget,
    pair_tokens,
    patchify,
    split_video,
    thin_pairs,
)

QWEN3_VIDEO = VideoConfig(
    min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16,
    image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
)  # fmt: skip
"""transformers' Qwen3VLVideoProcessor defaults (a checkpoint's video config overrides)."""
SAMPLE_FPS = 2.0


@dataclass(frozen=True)
class VideoSegments:
    """One video as prompt segments: per frame pair its timestamp and item."""

    timestamps: tuple[float, ...]
    items: tuple[MediaItem, ...]


def sample_indices(
    total: int, fps: float | None, cfg: VideoConfig, opts: VideoOptions
) -> list[int]:
    """transformers' Qwen3-VL ``sample_frames``."""
    n = opts.nframes
    if n is None:
        n = int(total / (fps or DEFAULT_FPS) * (opts.fps or SAMPLE_FPS))
        n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    if n <= 0 or n > total:
        raise InvalidRequestError(f"can not sample {n} frames from a video of {total}")
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def smart_resize(frames: int, height: int, width: int, cfg: VideoConfig,
                 min_pixels: int, max_pixels: int) -> tuple[int, int]:  # fmt: skip
    """transformers' Qwen3-VL rule: the sampled frames' total pixels within [min, max]."""
    factor, tp = cfg.patch_size * cfg.merge_size, cfg.temporal_patch_size
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError("video aspect ratio must be smaller than 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(frames / tp) * tp
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def pair_timestamps(indices: list[int], fps: float, tp: int) -> list[float]:
    """transformers' ``_calculate_timestamps``: each pair's mean of first and last frame."""
    padded = indices + [indices[-1]] * (-len(indices) % tp)
    seconds = [i / fps for i in padded]
    return [(seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp)]


def video_segments(video: object, cfg: VideoConfig, opts: VideoOptions,
                   max_pixels_cap: int | None, max_tokens: int | None = None) -> VideoSegments:  # fmt: skip
    """One video -> its frame-pair segments. ``max_tokens``: the video's share of the
    prompt's visual-token budget. Qwen3-VL sizes frames by the total pixels of all sampled
    frames, so the budget first lowers that total (the frames' resolution, their count
    kept: tokens = frames x h x w / (temporal patch x unit^2)); where the smallest frames
    still do not fit, fewer pairs are sampled (evenly among those chosen)."""
    frames, fps = split_video(video)
    height, width = frames[0].shape[:2]
    if max_pixels_cap is not None and height * width > max_pixels_cap:
        raise InvalidRequestError(
            f"video frames of {width}x{height} are over the {max_pixels_cap}-pixel cap"
        )
    indices = sample_indices(len(frames), fps, cfg, opts)
    lo, hi = opts.min_pixels or cfg.min_pixels, opts.max_pixels or cfg.max_pixels
    if max_tokens is not None:
        unit = cfg.patch_size * cfg.merge_size
        hi = min(hi, max_tokens * cfg.temporal_patch_size * unit * unit)
    size = smart_resize(len(indices), height, width, cfg, lo, hi)
    while max_tokens is not None and num_pairs(indices, cfg) * pair_tokens(size, cfg) > max_tokens:
        pairs = min(num_pairs(indices, cfg) - 1, max_tokens // pair_tokens(size, cfg))
        if pairs < 1:
            raise pair_over_budget(pair_tokens(size, cfg), max_tokens)
        indices = thin_pairs(indices, pairs, cfg)
        size = smart_resize(len(indices), height, width, cfg, lo, hi)  # fewer frames: larger
    patches, (t, h, w) = patchify(np.stack([_frame(frames[i], size, cfg) for i in indices]), cfg)
    pixels = torch.from_numpy(patches).view(t, h * w, -1)
    unit = cfg.merge_size**2
    items = tuple(MediaItem("video", content_hash("video", px, (1, h, w)), px, (1, h, w),
                            h * w // unit) for px in pixels.unbind(0))  # fmt: skip
    stamps = pair_timestamps(indices, fps or DEFAULT_FPS, cfg.temporal_patch_size)
    return VideoSegments(tuple(stamps), items)


def segment_ids(seg: VideoSegments, encode: Callable[[str], list[int]], start: int, end: int,
                pad: int) -> list[int]:  # fmt: skip
    """The video's tokens: per pair ``<t seconds>`` + start + its pad run + end."""
    out: list[int] = []
    for stamp, item in zip(seg.timestamps, seg.items):
        out += encode(f"<{stamp:.1f} seconds>") + [start] + [pad] * item.num_tokens + [end]
    return out


def runs_of(ids: list[int], tokens: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(token, offset, length) of each maximal run of one of ``tokens``, in prompt order."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] in tokens:
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            out.append((ids[i], i, j - i))
            i = j
        else:
            i += 1
    return out
