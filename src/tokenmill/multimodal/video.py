"""Qwen-VL video processing without torchvision: frame sampling, resize, patches.

transformers' Qwen2-VL video processor needs torchvision (not usable with this torch), so
this follows its rules with PIL: frames sampled by ``fps`` or ``nframes`` (its
``sample_frames``: a multiple of the temporal patch size, at least ``min_frames``), each
frame resized by ``smart_resize`` with PIL bicubic and normalized exactly as the image
processor does a picture, frames paired along time (the last repeated to fill a pair),
patches laid out merge-block-major as its ``patchify`` lays them. The temporal M-RoPE step
is ``tokens_per_second * temporal_patch_size / sampled fps`` (unknown fps: 24, as
transformers' ``VideoMetadata``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.inputs import MediaItem

DEFAULT_FPS = 24.0


@dataclass(frozen=True)
class VideoOptions:
    """Per-request video options (None: the processor's defaults)."""

    fps: float | None = None
    """Frames per second to sample (the video's own fps must be known or defaults to 24)."""
    nframes: int | None = None
    """Frames to sample, spread evenly (rounded to the temporal patch size)."""
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass(frozen=True)
class VideoConfig:
    """The video processor's settings (transformers' Qwen2VLVideoProcessor defaults)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    min_frames: int = 4
    max_frames: int = 768
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)


def split_video(video: Any) -> tuple[list[np.ndarray], float | None]:
    """A video as given -> (frames [H, W, 3] uint8, its fps or None). Accepted: an array
    [T, H, W, 3], a list of frames (arrays or PIL images), or ``(frames, {"fps": ...})``."""
    fps = None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping):
        video, meta = video
        fps = meta.get("fps")
    try:
        frames = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f)
                  for f in video]  # fmt: skip
    except TypeError as e:
        raise InvalidRequestError(
            f"a video must be a [T, H, W, 3] array or a list of frames: {e}"
        ) from e
    if not frames or any(
        f.ndim != 3 or f.shape[-1] != 3 or f.shape != frames[0].shape for f in frames
    ):
        raise InvalidRequestError(
            "a video must have at least one frame, each [H, W, 3], all the same size"
        )
    return [f.astype(np.uint8, copy=False) for f in frames], fps


def sample_indices(
    total: int, fps: float | None, cfg: VideoConfig, opts: VideoOptions
) -> list[int]:
    """transformers' ``sample_frames``: all frames unless ``nframes`` or ``fps`` says."""
    tp = cfg.temporal_patch_size
    if opts.nframes is not None:
        n = round(opts.nframes / tp) * tp
    elif opts.fps is not None:
        most = math.floor(min(cfg.max_frames, total) / tp) * tp
        wanted = min(max(total / (fps or DEFAULT_FPS) * opts.fps, cfg.min_frames), most, total)
        n = math.floor(wanted / tp) * tp
    else:
        return list(range(total))
    if n <= 0 or n > total:
        raise InvalidRequestError(f"can not sample {n} frames from a video of {total}")
    return torch.arange(0, total, total / n).int().tolist()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen-VL's rule: sides multiples of ``factor``, pixels within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise InvalidRequestError("video aspect ratio must be smaller than 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _frame(frame: np.ndarray, size: tuple[int, int], cfg: VideoConfig) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, h, w] float32, resized (PIL bicubic) and normalized as the
    PIL image processor does."""
    from PIL import Image

    h, w = size
    resized = np.asarray(Image.fromarray(frame).resize((w, h), Image.Resampling.BICUBIC))
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)  # transformers' rounding
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


def patchify(frames: np.ndarray, cfg: VideoConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, C, H, W] -> ([t*h*w, C*tp*P*P], (t, h, w)); T padded with the last frame."""
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -frames.shape[0] % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    n, c, height, width = frames.shape
    gt, gh, gw = n // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h-blocks, w-blocks, h-in, w-in, C, tp, P, P
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)


def video_item(video: Any, cfg: VideoConfig, opts: VideoOptions, tokens_per_second: float,
               max_pixels_cap: int | None, max_tokens: int | None = None) -> MediaItem:  # fmt: skip
    """One video -> its processed ``MediaItem`` (placeholder tokens t*h*w / merge^2).
    ``max_tokens``: the video's share of the prompt's visual-token budget; fewer frame
    pairs are sampled (evenly among those chosen) until it fits."""
    frames, fps = split_video(video)
    height, width = frames[0].shape[:2]
    if max_pixels_cap is not None and height * width > max_pixels_cap:
        raise InvalidRequestError(
            f"video frames of {width}x{height} are over the {max_pixels_cap}-pixel cap"
        )
    indices = sample_indices(len(frames), fps, cfg, opts)
    factor = cfg.patch_size * cfg.merge_size
    size = smart_resize(
        height, width, factor, opts.min_pixels or cfg.min_pixels, opts.max_pixels or cfg.max_pixels
    )
    if max_tokens is not None:
        indices = _within_budget(indices, size, cfg, max_tokens)
    stack = np.stack([_frame(frames[i], size, cfg) for i in indices])
    patches, grid = patchify(stack, cfg)
    sampled_fps = len(indices) / len(frames) * (fps or DEFAULT_FPS)
    pixels = torch.from_numpy(patches)
    interval = tokens_per_second * cfg.temporal_patch_size / sampled_fps
    num_tokens = grid[0] * grid[1] * grid[2] // cfg.merge_size**2
    return MediaItem(
        "video", content_hash("video", pixels, grid), pixels, grid, num_tokens, interval
    )


def _within_budget(
    indices: list[int], size: tuple[int, int], cfg: VideoConfig, budget: int
) -> list[int]:
    """The sampled frames cut to the pairs ``budget`` tokens pay for (at least one pair)."""
    pairs = budget // pair_tokens(size, cfg)
    if pairs < 1:
        raise pair_over_budget(pair_tokens(size, cfg), budget)
    return indices if num_pairs(indices, cfg) <= pairs else thin_pairs(indices, pairs, cfg)


def pair_tokens(size: tuple[int, int], cfg: VideoConfig) -> int:
    """Placeholder tokens of one temporal patch (frame pair) of ``size`` (h, w) pixels."""
    unit = cfg.patch_size * cfg.merge_size
    return (size[0] // unit) * (size[1] // unit)


def num_pairs(indices: list[int], cfg: VideoConfig) -> int:
    """Temporal patches of the sampled frames (the last one padded by repetition)."""
    return -(-len(indices) // cfg.temporal_patch_size)


def thin_pairs(indices: list[int], pairs: int, cfg: VideoConfig) -> list[int]:
    """``pairs`` temporal patches' worth of ``indices``, spread evenly over them."""
    keep = np.linspace(0, len(indices) - 1, pairs * cfg.temporal_patch_size)
    return [indices[k] for k in keep.round().astype(int).tolist()]


def pair_over_budget(per_pair: int, budget: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"a video frame pair takes {per_pair} tokens, more than the {budget} left of the "
        "prompt's visual-token budget (max_visual_tokens_per_prompt); raise the budget, "
        "lower max_pixels, or send fewer or smaller media"
    )
