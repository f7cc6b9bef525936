"""The boundary for Qwen3-VL: images as Qwen-VL's (``processing.QwenVLProcessor``), videos
as timestamped frame-pair segments (``qwen3_video.py``), then M-RoPE positions over the
runs (each pair placed like an image, as transformers splits a video per frame)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.multimodal.media import load_image
from tokenmill.multimodal.mrope import mrope_positions
from tokenmill.multimodal.options import MediaOptions, check_counts, refuse_options
from tokenmill.multimodal.processing import (
    QwenVLProcessor,
    check_modalities,
    expand_placeholders,
    media_list,
    placeholder_marks,
)
from tokenmill.multimodal.qwen3_video import VideoSegments, runs_of, segment_ids, video_segments


class Qwen3VLProcessor(QwenVLProcessor):
    """``QwenVLProcessor`` plus the tokenizer (timestamps are text)."""

    def __init__(self, *args: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokenizer = tokenizer

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        check_modalities(data, ("image", "video"))
        images, videos = media_list(data.get("image")), media_list(data.get("video"), video=True)
        check_counts({"image": len(images), "video": len(videos)}, self.limits)
        opts = self.defaults.merged(options)
        refuse_options(opts.image, "Qwen3-VL", ("min_pixels", "max_pixels"))
        info = self.info
        image_items = self._items([load_image(i, self.max_pixels_cap) for i in images], opts.image)
        ids, _ = expand_placeholders(
            prompt_ids, {info.image_token_id: [it.num_tokens for it in image_items]}
        )
        shares = self._video_shares(sum(it.num_tokens for it in image_items), len(videos))
        segments = [
            video_segments(v, self.video, opts.video, self.max_pixels_cap, share)
            for v, share in zip(videos, shares)
        ]
        ids = self._expand_videos(ids, segments)
        items, ranges = _place(ids, image_items, [it for s in segments for it in s.items],
                               (info.image_token_id, info.video_token_id))  # fmt: skip
        positions, delta = mrope_positions(len(ids), items, ranges, info.merge_size)
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(images) + len(videos)
        return ids, MultiModalInputs(items, ranges, positions, delta, seconds)

    def _expand_videos(self, ids: list[int], segments: list[VideoSegments]) -> list[int]:
        pad = self.info.video_token_id
        marks = placeholder_marks(ids, pad, len(segments), "video",
                                  "<|vision_start|><|video_pad|><|vision_end|>")  # fmt: skip
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        out: list[int] = []
        prev = 0
        for pos, seg in zip(marks, segments):
            out += ids[prev:pos]
            out += segment_ids(seg, encode, self.info.start_token_id, self.info.end_token_id, pad)
            prev = pos + 1
        return out + ids[prev:]


def _place(
    ids: list[int], images: list[MediaItem], pairs: list[MediaItem], tokens: tuple[int, int]
) -> tuple[tuple[MediaItem, ...], tuple[PlaceholderRange, ...]]:
    """Items in prompt order with their runs (each image and each frame pair one run)."""
    queues = {tokens[0]: iter(images), tokens[1]: iter(pairs)}
    items: list[MediaItem] = []
    ranges: list[PlaceholderRange] = []
    for token, offset, length in runs_of(ids, tokens):
        item = next(queues[token], None)
        if item is None or item.num_tokens != length:
            raise InvalidRequestError(
                "the prompt's <|image_pad|> / <|video_pad|> runs do not match its media: write "
                "one placeholder per image or video, not expanded runs"
            )
        items.append(item)
        ranges.append(PlaceholderRange(offset, length))
    if len(items) != len(images) + len(pairs):
        raise InvalidRequestError("the prompt's placeholder runs do not match its media")
    return tuple(items), tuple(ranges)
