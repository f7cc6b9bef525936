"""The boundary for SmolVLM / Idefics3: images -> tiles -> ``<image>`` runs.

transformers' PIL image processor of the checkpoint (``SmolVLMImageProcessorPil`` /
``Idefics3ImageProcessorPil``, settings from ``preprocessor_config.json``) resizes and
splits each image into rows x cols square tiles plus a global view, with a pixel mask for
the padded ones; each ``<image>`` of the prompt becomes transformers' own prompt string
for that split (``get_image_prompt_string``: ``<fake_token_around_image><row_i_col_j>``
then the tile's ``<image>`` run, row by row, then ``<global-img>`` and the global view's
run), tokenized and spliced in. Every run is one media item (one tile), hashed alone, so
an image seen again hits the encoder cache tile by tile.
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
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.multimodal.media import load_image
from tokenmill.multimodal.model import MultiModalInfo
from tokenmill.multimodal.options import MediaOptions, check_counts, refuse_options
from tokenmill.multimodal.processing import check_modalities, media_list, placeholder_marks

_PROCESSOR_KEYS = (
    "do_convert_rgb", "do_resize", "size", "resample", "do_image_splitting", "max_image_size",
    "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std", "do_pad",
)  # fmt: skip


def load_idefics3_image_processor(folder: Path | None, kind: str) -> Any:
    """transformers' PIL image processor of ``kind`` ("smolvlm" or "idefics3") with the
    folder's preprocessor_config.json."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    config: dict[str, Any] = {}
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    if path is not None and path.is_file():
        config = json.loads(path.read_text())
    cls: Any = SmolVLMImageProcessorPil
    if kind == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import (
            Idefics3ImageProcessorPil,
        )

        cls = Idefics3ImageProcessorPil
    return cls(**{k: v for k, v in config.items() if k in _PROCESSOR_KEYS})


class Idefics3Processor:
    def __init__(
        self, info: MultiModalInfo, image_processor: Any, tokenizer: Any,
        limits: Mapping[str, int], max_pixels_cap: int | None = None,
        defaults: MediaOptions | None = None,
    ) -> None:  # fmt: skip
        self.info = info
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.defaults = defaults or MediaOptions()
        """The ``LLM``'s ``mm_processor_kwargs``; a request's own win per option."""
        self.limits = dict(limits)
        self.max_pixels_cap = max_pixels_cap
        self.preprocess_seconds = 0.0
        self.items_processed = 0

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        check_modalities(data, ("image",))
        kwargs = self._processor_kwargs(options)
        raw = data.get("image")
        images = media_list(raw)
        check_counts({"image": len(images)}, self.limits)
        token = self.info.image_token_id
        marks = placeholder_marks(prompt_ids, token, len(images),
                                  "<image> image", "<image>")  # fmt: skip
        if not images:
            return prompt_ids, MultiModalInputs((), ())
        pils = [load_image(img, self.max_pixels_cap) for img in images]
        out = self.image_processor(
            images=[pils], return_tensors="np", return_row_col_info=True, **kwargs
        )
        ids = self._expand(prompt_ids, marks, out["rows"][0], out["cols"][0])
        items = self._tiles(out["pixel_values"][0], out["pixel_attention_mask"][0])
        runs = _runs(ids, token)
        if len(runs) != len(items) or any(r.length != self.info.tile_tokens for r in runs):
            raise InvalidRequestError("the expanded prompt's <image> runs do not match the tiles")
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(images)
        return ids, MultiModalInputs(tuple(items), tuple(runs), None, 0, seconds)

    def _processor_kwargs(self, options: MediaOptions) -> dict[str, Any]:
        """The options transformers' image processor takes per call: ``do_image_splitting``
        and ``size`` (the tile size, ``max_image_size``, is the vision tower's: fixed)."""
        opts = self.defaults.merged(options).image
        refuse_options(opts, "SmolVLM / Idefics3", ("do_image_splitting", "longest_edge"))
        kwargs: dict[str, Any] = {}
        if opts.do_image_splitting is not None:
            kwargs["do_image_splitting"] = opts.do_image_splitting
        if opts.longest_edge is not None:
            kwargs["size"] = {"longest_edge": opts.longest_edge}
        return kwargs

    def _expand(
        self, ids: list[int], marks: list[int], rows: list[int], cols: list[int]
    ) -> list[int]:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        out: list[int] = []
        prev = 0
        for pos, r, c in zip(marks, rows, cols):
            text = get_image_prompt_string(
                r, c, self.info.tile_tokens, fake_token_around_image="<fake_token_around_image>",
                image_token="<image>", global_image_token="<global-img>",
            )  # fmt: skip
            out += ids[prev:pos] + self.tokenizer.encode(text, add_special_tokens=False)
            prev = pos + 1
        return out + ids[prev:]

    def _tiles(self, pixels: np.ndarray, masks: np.ndarray) -> list[MediaItem]:
        items = []
        for px, mask in zip(pixels, masks):
            if not px.any():  # the processor pads a batch with empty images
                continue
            t = torch.from_numpy(np.ascontiguousarray(px, dtype=np.float32))
            m = torch.from_numpy(np.ascontiguousarray(mask)).bool()
            key = content_hash(
                "tile", torch.cat((t.flatten(), m.flatten().float())), tuple(t.shape)
            )
            items.append(
                MediaItem("image", key, t, (1, *t.shape[1:]), self.info.tile_tokens, 1.0, m)
            )
        return items


def _runs(ids: list[int], token: int) -> list[PlaceholderRange]:
    runs: list[PlaceholderRange] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append(PlaceholderRange(i, j - i))
            i = j
        else:
            i += 1
    return runs
