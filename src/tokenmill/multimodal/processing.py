"""The boundary: (prompt ids, media) -> (ids with placeholder runs, ``MultiModalInputs``).

Images go through transformers' Qwen2-VL image processor (the PIL one: the torchvision
"fast" one needs a torchvision built for this torch), configured from the checkpoint's
``preprocessor_config.json``. Each ``<|image_pad|>`` the prompt holds (the chat template
writes one per image part) becomes a run of exactly t * h * w / merge^2 of them, the
encoder's output rows for that image.
"""

from __future__ import annotations

import dataclasses
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
from tokenmill.multimodal.options import (
    ImageOptions,
    MediaOptions,
    check_counts,
    refuse_options,
)
from tokenmill.multimodal.video import VideoConfig, video_item

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


def load_video_config(folder: Path | None, base: VideoConfig | None = None) -> VideoConfig:
    """The video settings: ``video_preprocessor_config.json``, else the image processor's
    ``preprocessor_config.json`` (transformers' fallback), else ``base`` (default: the
    Qwen2-VL video processor's defaults)."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = None if folder is None else Path(folder) / name
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text())
            size = cfg.get("size") or {}
            known = {k: cfg[k] for k in VideoConfig.__dataclass_fields__ if k in cfg}
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if key not in known and edge in size:
                    known[key] = size[edge]
            for key in ("image_mean", "image_std"):
                if key in known:
                    known[key] = tuple(known[key])
            return dataclasses.replace(base or VideoConfig(), **known)
    return base or VideoConfig()


class QwenVLProcessor:
    """Processes one prompt's images and videos for a Qwen2-VL / Qwen2.5-VL model."""

    def __init__(
        self,
        info: MultiModalInfo,
        image_processor: Any,
        defaults: MediaOptions,
        limits: Mapping[str, int],
        max_pixels_cap: int | None = None,
        video: VideoConfig | None = None,
        max_visual_tokens: int | None = None,
    ) -> None:
        self.info = info
        self.image_processor = image_processor
        self.video = video or VideoConfig()
        self.defaults = defaults
        self.limits = dict(limits)
        self.max_pixels_cap = max_pixels_cap
        """Refuse (not resize) source images with more pixels than this (None: no cap)."""
        self.max_visual_tokens = max_visual_tokens
        """Placeholder tokens one prompt's images and videos may take together: images
        first, videos share the rest (fewer frames sampled); None: no budget."""
        self.preprocess_seconds = 0.0
        """Total time spent loading and processing media (metrics)."""
        self.items_processed = 0

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        check_modalities(data, ("image", "video"))
        images, videos = media_list(data.get("image")), media_list(data.get("video"), video=True)
        if videos and self.info.video_token_id < 0:
            raise InvalidRequestError(
                "this model takes images only here (its video input is not built yet); "
                "send the frames as images"
            )
        check_counts({"image": len(images), "video": len(videos)}, self.limits)
        opts = self.defaults.merged(options)
        refuse_options(opts.image, "Qwen-VL", ("min_pixels", "max_pixels"))
        pils = [load_image(img, self.max_pixels_cap) for img in images]
        image_items = self._items(pils, opts.image)
        shares = self._video_shares(sum(it.num_tokens for it in image_items), len(videos))
        by_token = {
            self.info.image_token_id: image_items,
            self.info.video_token_id: [
                video_item(v, self.video, opts.video, self.info.tokens_per_second,
                           self.max_pixels_cap, share)
                for v, share in zip(videos, shares)
            ],
        }  # fmt: skip
        ids, placed = expand_placeholders(
            prompt_ids, {t: [it.num_tokens for it in items] for t, items in by_token.items()}
        )
        items = tuple(by_token[t][k] for t, k, _ in placed)
        ranges = tuple(r for _, _, r in placed)
        positions, delta = None, 0
        if self.info.uses_mrope:
            positions, delta = mrope_positions(len(ids), items, ranges, self.info.merge_size)
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(items)
        return ids, MultiModalInputs(items, ranges, positions, delta, seconds)

    def _video_shares(self, image_tokens: int, num_videos: int) -> list[int | None]:
        """Each video's share of what the images leave of the visual-token budget."""
        budget = self.max_visual_tokens
        if budget is None:
            return [None] * num_videos
        if image_tokens > budget:
            raise InvalidRequestError(
                f"the prompt's images take {image_tokens} tokens, over the visual-token budget "
                f"of {budget} (max_visual_tokens_per_prompt); send fewer or smaller images"
            )
        return [(budget - image_tokens) // num_videos] * num_videos

    def _items(self, images: Sequence[Any], opts: ImageOptions) -> list[MediaItem]:
        """Images -> items, through transformers' image processor in one call."""
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


_NAMES = {0: "image", 1: "video"}


def check_modalities(data: Mapping[str, Any], accepted: tuple[str, ...]) -> None:
    """Refuse ``multi_modal_data`` keys this model does not take."""
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        takes = " and ".join(repr(k) for k in accepted)
        raise InvalidRequestError(
            f"multi_modal_data: {unknown} not supported by this model yet; it takes {takes}"
        )


def placeholder_marks(ids: list[int], token: int, count: int, what: str, hint: str) -> list[int]:
    """Positions of ``token`` in ``ids``; there must be one per item (``count`` of them).
    ``what``: the placeholder and the item ("<image>", "image"); ``hint``: what to put."""
    marks = [i for i, t in enumerate(ids) if t == token]
    if len(marks) != count:
        spelling, item = what.split(" ", 1) if " " in what else (what, what)
        raise InvalidRequestError(
            f"the prompt has {len(marks)} {spelling} placeholder(s) and {count} {item}(s) were "
            f"given; put one {hint} per {item} in the prompt"
        )
    return marks


def media_list(raw: Any, video: bool = False) -> list[Any]:
    """One item or a list of them. A video is itself an array [T, H, W, 3], a list of
    frames or a (frames, metadata) tuple, so a list is of videos only when its first
    element is one of those (not a frame)."""
    if raw is None:
        return []
    if not video:
        return list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if isinstance(raw, list) and raw and _is_video(raw[0]):
        return raw
    return [raw]


def _is_video(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return x.ndim == 4
    return isinstance(x, (list, tuple))


def expand_placeholders(
    ids: list[int], counts: Mapping[int, list[int]]
) -> tuple[list[int], list[tuple[int, int, PlaceholderRange]]]:
    """Each placeholder token t of ``ids`` -> a run of counts[t][k] of them (k: its index
    among t's); returns the ids and, in prompt order, (token, k, range). The number of
    placeholders of each token must equal its number of items."""
    found = {t: [i for i, x in enumerate(ids) if x == t] for t in counts}
    for n, (t, where) in enumerate(found.items()):
        if len(where) != len(counts[t]):
            kind = _NAMES.get(n, "media")
            raise InvalidRequestError(
                f"the prompt has {len(where)} {kind} placeholder(s) and {len(counts[t])} "
                f"{kind}(s) were given; put one <|vision_start|><|{kind}_pad|><|vision_end|> "
                f"per {kind} in the prompt (the chat template does this for {kind} parts)"
            )
    marks = sorted((i, t, k) for t, where in found.items() for k, i in enumerate(where))
    out: list[int] = []
    placed: list[tuple[int, int, PlaceholderRange]] = []
    prev = 0
    for pos, t, k in marks:
        out += ids[prev:pos]
        n = counts[t][k]
        placed.append((t, k, PlaceholderRange(len(out), n)))
        out += [t] * n
        prev = pos + 1
    out += ids[prev:]
    return out, placed
