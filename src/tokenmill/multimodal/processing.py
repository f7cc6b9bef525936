"""The boundary: (prompt ids, media) -> (ids with placeholder runs, ``MultiModalInputs``).

Images go through transformers' Qwen2-VL image processor (the PIL one: the torchvision
"fast" one needs a torchvision built for this torch), configured from the checkpoint's
``preprocessor_config.json``. Each ``<|image_pad|>`` the prompt holds (the chat template
writes one per image part) becomes a run of exactly t * h * w / merge^2 of them, the
encoder's output rows for that image.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.multimodal.media import load_image
from tokenmill.multimodal.model import MultiModalInfo
from tokenmill.multimodal.mrope import mrope_positions
from tokenmill.multimodal.options import ImageOptions, check_counts

_PROCESSOR_KEYS = (
    "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
    "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size",
    "min_pixels", "max_pixels", "size",
)  # fmt: skip


def load_image_processor(folder: Path | None) -> Any:
    """transformers' Qwen2-VL PIL image processor with the checkpoint's settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    config: dict[str, Any] = {}
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in config.items() if k in _PROCESSOR_KEYS})


class QwenVLProcessor:
    """Processes one prompt's images for a Qwen2-VL / Qwen2.5-VL model."""

    def __init__(
        self,
        info: MultiModalInfo,
        image_processor: Any,
        defaults: ImageOptions,
        limits: Mapping[str, int],
        max_pixels_cap: int | None = None,
    ) -> None:
        self.info = info
        self.image_processor = image_processor
        self.defaults = defaults
        self.limits = dict(limits)
        self.max_pixels_cap = max_pixels_cap
        """Refuse (not resize) source images with more pixels than this (None: no cap)."""
        self.preprocess_seconds = 0.0
        """Total time spent loading and processing media (metrics)."""
        self.items_processed = 0

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: ImageOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise InvalidRequestError(
                f"multi_modal_data: {unknown} not supported by this model yet; it takes 'image'"
            )
        raw = data.get("image")
        images = [] if raw is None else list(raw) if isinstance(raw, (list, tuple)) else [raw]
        check_counts({"image": len(images)}, self.limits)
        pils = [load_image(img, self.max_pixels_cap) for img in images]
        items = self._items(pils, self.defaults.merged(options))
        ids, ranges = expand_placeholders(
            prompt_ids, self.info.image_token_id, [it.num_tokens for it in items]
        )
        positions, delta = None, 0
        if self.info.uses_mrope:
            positions, delta = mrope_positions(len(ids), tuple(items), ranges, self.info.merge_size)
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(items)
        return ids, MultiModalInputs(tuple(items), ranges, positions, delta, seconds)

    def _items(self, images: Sequence[Any], opts: ImageOptions) -> list[MediaItem]:
        if not images:
            return []
        proc = self.image_processor
        size = dict(proc.size)
        if opts.min_pixels is not None:
            size["shortest_edge"] = opts.min_pixels
        if opts.max_pixels is not None:
            size["longest_edge"] = opts.max_pixels
        try:
            out = proc(images=list(images), size=size, return_tensors="np")
        except ValueError as e:  # e.g. an aspect ratio over 200
            raise InvalidRequestError(f"image could not be processed: {e}") from e
        pixels = torch.from_numpy(np.ascontiguousarray(out["pixel_values"]))
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        unit = self.info.merge_size**2
        items, start = [], 0
        for t, h, w in grids:
            n = t * h * w
            px = pixels[start : start + n]
            start += n
            grid = (t, h, w)
            items.append(MediaItem("image", content_hash("image", px, grid), px, grid, n // unit))
        return items


def expand_placeholders(
    ids: list[int], token: int, counts: list[int]
) -> tuple[list[int], tuple[PlaceholderRange, ...]]:
    """Each ``token`` in ``ids`` -> a run of counts[i] of them; their ranges. The number of
    placeholders must equal the number of items."""
    found = [i for i, t in enumerate(ids) if t == token]
    if len(found) != len(counts):
        raise InvalidRequestError(
            f"the prompt has {len(found)} image placeholder(s) and {len(counts)} image(s) were "
            "given; put one <|vision_start|><|image_pad|><|vision_end|> per image in the prompt "
            "(the chat template does this for image parts)"
        )
    out: list[int] = []
    ranges: list[PlaceholderRange] = []
    prev = 0
    for pos, n in zip(found, counts):
        out += ids[prev:pos]
        ranges.append(PlaceholderRange(len(out), n))
        out += [token] * n
        prev = pos + 1
    out += ids[prev:]
    return out, tuple(ranges)
