"""Multimodal options, checked at the boundary: ``mm_processor_kwargs`` and
``limit_mm_per_prompt`` (vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError

MODALITIES = ("image", "video", "audio")

# Option -> check of its value; the image processor reads these.
_IMAGE_OPTIONS = ("min_pixels", "max_pixels")


@dataclass(frozen=True)
class ImageOptions:
    """Resolved image-processor options of one request (None: the checkpoint's value)."""

    min_pixels: int | None = None
    max_pixels: int | None = None

    def merged(self, other: ImageOptions) -> ImageOptions:
        """``other``'s values where it has them, else these (per request over per LLM)."""
        return ImageOptions(
            other.min_pixels if other.min_pixels is not None else self.min_pixels,
            other.max_pixels if other.max_pixels is not None else self.max_pixels,
        )


def parse_processor_kwargs(kwargs: Mapping[str, Any] | None) -> ImageOptions:
    """``{"min_pixels": ..., "max_pixels": ...}`` or HF-style ``{"images_kwargs": {...}}``.

    An option given both at the top level and in ``images_kwargs`` is an error, as is an
    unknown option or a value that is not a positive integer, or min_pixels > max_pixels.
    """
    if kwargs is None:
        return ImageOptions()
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}"
        )
    top = dict(kwargs)
    nested = top.pop("images_kwargs", None) or {}
    if not isinstance(nested, Mapping):
        raise InvalidRequestError("mm_processor_kwargs['images_kwargs'] must be a dict")
    unknown = sorted((top.keys() | nested.keys()) - set(_IMAGE_OPTIONS))
    if unknown:
        raise InvalidRequestError(
            f"mm_processor_kwargs: unknown option(s) {unknown}; known: {list(_IMAGE_OPTIONS)} "
            "(top level or inside images_kwargs)"
        )
    both = sorted(top.keys() & nested.keys())
    if both:
        raise InvalidRequestError(
            f"mm_processor_kwargs: {both} given both at the top level and in images_kwargs; "
            "give each option once"
        )
    values = {**top, **nested}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidRequestError(
                f"mm_processor_kwargs: {name} must be a positive integer, got {value!r}"
            )
    opts = ImageOptions(values.get("min_pixels"), values.get("max_pixels"))
    if (
        opts.min_pixels is not None
        and opts.max_pixels is not None
        and opts.min_pixels > opts.max_pixels
    ):
        raise InvalidRequestError(
            f"mm_processor_kwargs: min_pixels={opts.min_pixels} is larger than max_pixels={opts.max_pixels}"
        )
    return opts


def parse_limits(limits: Mapping[str, Any] | None) -> dict[str, int]:
    """``limit_mm_per_prompt``: modality -> most items per prompt (default 1 image per prompt
    is vLLM's; here the default is 8 images and no video or audio until they are built)."""
    out = {"image": 8, "video": 0, "audio": 0}
    for name, value in (limits or {}).items():
        if name not in MODALITIES:
            raise InvalidRequestError(
                f"limit_mm_per_prompt: unknown modality {name!r}; use {list(MODALITIES)}"
            )
        if isinstance(value, Mapping):  # vLLM 0.10 also takes {"count": n, ...}
            value = value.get("count")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(
                f"limit_mm_per_prompt[{name!r}] must be an integer >= 0, got {value!r}"
            )
        out[name] = value
    return out


def check_counts(counts: Mapping[str, int], limits: Mapping[str, int]) -> None:
    for modality, n in counts.items():
        limit = limits.get(modality, 0)
        if n > limit:
            raise InvalidRequestError(
                f"this prompt has {n} {modality} item(s); at most {limit} allowed per prompt "
                f"(limit_mm_per_prompt={{{modality!r}: {limit}}})"
            )
