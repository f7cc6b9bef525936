"""The boundary for Gemma 3: each ``<start_of_image>`` -> transformers' image sequence.

transformers' PIL Gemma 3 image processor (settings from ``preprocessor_config.json``)
resizes every image to S x S (896 for the released checkpoints) and normalizes it. Each
``<start_of_image>`` of the prompt becomes transformers' own text for it,
``"\\n\\n<start_of_image>" + <image_soft_token> x 256 + "<end_of_image>\\n\\n"``, tokenized
and spliced in. With pan-and-scan (``do_pan_and_scan`` in ``mm_processor_kwargs`` or the
checkpoint's config) an image far from square also gets crops, and its text is
transformers' "Here is the original image ... and here are some crops ..." with one such
sequence per view. Every view is one media item with its own run; runs are bidirectional
(``MultiModalInputs.bidirectional``), so each must fit one prefill chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.encoder_budget import check_whole_runs
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.idefics3 import _runs
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs
from tokenmill.multimodal.media import load_image
from tokenmill.multimodal.model import MultiModalInfo
from tokenmill.multimodal.options import MediaOptions, check_counts, refuse_options
from tokenmill.multimodal.processing import media_list, placeholder_marks

_PROCESSOR_KEYS = (
    "do_convert_rgb", "do_resize", "size", "resample", "do_rescale", "rescale_factor",
    "do_normalize", "image_mean", "image_std", "do_pan_and_scan", "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate",
)  # fmt: skip
_PAN_AND_SCAN_DEFAULTS = {
    "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}  # fmt: skip
"""transformers' Gemma3Processor values for what the released configs leave null."""


def load_gemma3_image_processor(folder: Path | None) -> Any:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    config: dict[str, Any] = {}
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
    known = {k: v for k, v in config.items() if k in _PROCESSOR_KEYS and v is not None}
    return Gemma3ImageProcessorPil(**{**_PAN_AND_SCAN_DEFAULTS, **known})


class Gemma3Processor:
    def __init__(
        self, info: MultiModalInfo, image_processor: Any, tokenizer: Any,
        limits: Mapping[str, int], max_pixels_cap: int | None, max_chunk: int,
    ) -> None:  # fmt: skip
        self.info = info
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.defaults = MediaOptions()
        self.limits = dict(limits)
        self.max_pixels_cap = max_pixels_cap
        self.max_chunk = max_chunk
        """The longest prefill chunk a step may take (a run must fit one)."""
        self.preprocess_seconds = 0.0
        self.items_processed = 0
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.sequence = [*newlines, info.start_token_id, *[info.image_token_id] * info.tile_tokens,
                         info.end_token_id, *newlines]  # fmt: skip
        """One view's tokens: transformers' ``full_image_sequence``."""

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        if set(data) - {"image"}:
            raise InvalidRequestError(
                f"multi_modal_data: {sorted(set(data) - {'image'})} not supported by this "
                "model; it takes 'image'"
            )
        pan = self._pan_and_scan(options)
        raw = data.get("image")
        images = media_list(raw)
        check_counts({"image": len(images)}, self.limits)
        marks = placeholder_marks(prompt_ids, self.info.start_token_id, len(images),
                                  "<start_of_image> image", "<start_of_image>")  # fmt: skip
        if not images:
            return prompt_ids, MultiModalInputs((), ())
        pils = [load_image(img, self.max_pixels_cap) for img in images]
        kwargs = {} if pan is None else {"do_pan_and_scan": pan}
        out = self.image_processor(images=pils, return_tensors="np", **kwargs)
        crops = [int(c) for c in out["num_crops"]]
        ids = self._expand(prompt_ids, marks, crops)
        items = [self._item(px) for px in out["pixel_values"]]
        runs = _runs(ids, self.info.image_token_id)
        if len(runs) != len(items) or any(r.length != self.info.tile_tokens for r in runs):
            raise InvalidRequestError(
                "the prompt's <image_soft_token> runs do not match its images: leave "
                "<image_soft_token> out of the prompt (each <start_of_image> becomes one run)"
            )
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(images)
        mm = MultiModalInputs(tuple(items), tuple(runs), None, 0, seconds, bidirectional=True)
        check_whole_runs(mm, self.max_chunk)
        return ids, mm

    def _pan_and_scan(self, options: MediaOptions) -> bool | None:
        opts = self.defaults.merged(options).image
        refuse_options(opts, "Gemma 3 (every image is resized to the checkpoint's size)",
                       ("do_pan_and_scan",))  # fmt: skip
        return opts.do_pan_and_scan

    def _expand(self, ids: list[int], marks: list[int], crops: list[int]) -> list[int]:
        """Each mark -> one image sequence, or with crops transformers' pan-and-scan text."""
        enc = self.tokenizer.encode
        out: list[int] = []
        prev = 0
        for pos, n in zip(marks, crops):
            out += ids[prev:pos]
            if n == 0:
                out += self.sequence
            else:
                out += enc("Here is the original image ", add_special_tokens=False)
                out += self.sequence
                out += enc(
                    " and here are some crops to help you see better ", add_special_tokens=False
                )
                for k in range(n):
                    out += (enc(" ", add_special_tokens=False) if k else []) + self.sequence
            prev = pos + 1
        return out + ids[prev:]

    def _item(self, px: np.ndarray) -> MediaItem:
        t = torch.from_numpy(np.ascontiguousarray(px, dtype=np.float32))  # [3, S, S]
        side = int(self.info.tile_tokens**0.5)  # the run as a grid of pooled tokens
        return MediaItem("image", content_hash("image", t, tuple(t.shape)), t, (1, side, side),
                         self.info.tile_tokens)  # fmt: skip
