"""Multimodal options, checked at the boundary: ``mm_processor_kwargs`` and
``limit_mm_per_prompt`` (vLLM's names)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.video import VideoOptions

MODALITIES = ("image", "video", "audio")

_PIXELS = ("min_pixels", "max_pixels")
_VIDEO_ONLY = ("fps", "nframes")
_IMAGE_FLAGS = ("do_pan_and_scan", "do_image_splitting")
"""Booleans: Gemma 3's pan-and-scan crops, SmolVLM / Idefics3's tiles; the processors that
have no such step refuse them (``refuse_options``)."""
_IMAGE_SIZES = ("size",)
"""``{"longest_edge": n}``: SmolVLM / Idefics3 resize an image's longer side to n (rounded
up to whole tiles) before splitting it."""
_IMAGE_ONLY = _IMAGE_FLAGS + _IMAGE_SIZES
_NESTED = {"images_kwargs": _PIXELS + _IMAGE_ONLY, "videos_kwargs": _PIXELS + _VIDEO_ONLY}
"""Where each option may be given: the top level holds every one of them (pixels apply
to images and videos), ``images_kwargs`` / ``videos_kwargs`` their modality's."""


@dataclass(frozen=True)
class ImageOptions:
    """Resolved image-processor options of one request (None: the checkpoint's value)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    do_pan_and_scan: bool | None = None
    """Gemma 3: also encode crops of an image far from square."""
    do_image_splitting: bool | None = None
    """SmolVLM / Idefics3: split an image into tiles plus a global view (False: one view)."""
    longest_edge: int | None = None
    """SmolVLM / Idefics3: ``size={"longest_edge": n}``, the longer side before splitting."""


@dataclass(frozen=True)
class MediaOptions:
    """A request's (or an LLM's) processor options per modality."""

    image: ImageOptions = ImageOptions()
    video: VideoOptions = VideoOptions()

    def merged(self, other: MediaOptions) -> MediaOptions:
        """``other``'s values where it has them, else these (per request over per LLM)."""
        return MediaOptions(_over(self.image, other.image), _over(self.video, other.video))


def _over(base: Any, top: Any) -> Any:
    values = {f: getattr(top, f) if getattr(top, f) is not None else getattr(base, f)
              for f in base.__dataclass_fields__}  # fmt: skip
    return type(base)(**values)


def parse_processor_kwargs(kwargs: Mapping[str, Any] | None) -> MediaOptions:
    """``{"min_pixels": ..., "max_pixels": ..., "fps" | "nframes": ...}`` or HF-style
    ``{"images_kwargs": {...}, "videos_kwargs": {...}}``.

    An option given both at the top level and in a modality's kwargs is an error, as is an
    unknown option, a value that is not positive, min_pixels > max_pixels, or both fps and
    nframes.
    """
    if kwargs is None:
        return MediaOptions()
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}"
        )
    top = {k: v for k, v in kwargs.items() if k not in _NESTED}
    _check_names(top, _PIXELS + _VIDEO_ONLY + _IMAGE_ONLY, "")
    per: dict[str, dict[str, Any]] = {}
    for name, allowed in _NESTED.items():
        nested = kwargs.get(name) or {}
        if not isinstance(nested, Mapping):
            raise InvalidRequestError(f"mm_processor_kwargs[{name!r}] must be a dict")
        _check_names(nested, allowed, f"{name}.")
        both = sorted(top.keys() & nested.keys())
        if both:
            raise InvalidRequestError(
                f"mm_processor_kwargs: {both} given both at the top level and in {name}; "
                "give each option once"
            )
        per[name] = {**{k: v for k, v in top.items() if k in allowed}, **nested}
    image, video = per["images_kwargs"], per["videos_kwargs"]
    for values in (image, video):
        _check_values(values)
    if video.get("fps") is not None and video.get("nframes") is not None:
        raise InvalidRequestError("mm_processor_kwargs: give fps or nframes, not both")
    size = image.pop("size", None)
    longest = None if size is None else size["longest_edge"]
    return MediaOptions(ImageOptions(**image, longest_edge=longest), VideoOptions(**video))


def _check_names(values: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise InvalidRequestError(
            f"mm_processor_kwargs: unknown option(s) {[where + u for u in unknown]}; known: "
            f"{list(_PIXELS + _VIDEO_ONLY + _IMAGE_ONLY)} (top level), {list(_NESTED)} for one "
            "modality"
        )


def _check_values(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        if name in _IMAGE_FLAGS:
            if not isinstance(value, bool):
                raise InvalidRequestError(
                    f"mm_processor_kwargs: {name} must be true or false, got {value!r}"
                )
            continue
        if name in _IMAGE_SIZES:
            _check_size(name, value)
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name != "fps" and not isinstance(value, int) or not number or value <= 0:
            kind = "a positive number" if name == "fps" else "a positive integer"
            raise InvalidRequestError(f"mm_processor_kwargs: {name} must be {kind}, got {value!r}")
    lo, hi = values.get("min_pixels"), values.get("max_pixels")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequestError(
            f"mm_processor_kwargs: min_pixels={lo} is larger than max_pixels={hi}"
        )


def _check_size(name: str, value: Any) -> None:
    edge = value.get("longest_edge") if isinstance(value, Mapping) else None
    if (
        not isinstance(value, Mapping)
        or set(value) != {"longest_edge"}
        or not isinstance(edge, int)
        or isinstance(edge, bool)
        or edge <= 0
    ):
        raise InvalidRequestError(
            f'mm_processor_kwargs: {name} must be {{"longest_edge": <positive integer>}}, '
            f"got {value!r}"
        )


_SHOWN = {"longest_edge": "size"}
"""``ImageOptions`` fields under their ``mm_processor_kwargs`` names."""


def refuse_options(options: ImageOptions, model: str, takes: tuple[str, ...]) -> None:
    """Image options the model's processor has no step for are errors, never ignored.

    ``takes``: the ``ImageOptions`` fields it applies."""
    given = [f for f in ImageOptions.__dataclass_fields__ if getattr(options, f) is not None]
    extra = [_SHOWN.get(f, f) for f in given if f not in takes]
    if extra:
        raise InvalidRequestError(
            f"mm_processor_kwargs: {extra} do not apply to {model}; it takes "
            f"{[_SHOWN.get(f, f) for f in takes] or 'no image options'}: remove them"
        )


def parse_limits(limits: Mapping[str, Any] | None) -> dict[str, int]:
    """``limit_mm_per_prompt``: modality -> most items per prompt (defaults here: 8 images,
    2 videos, 4 audio clips)."""
    out = {"image": 8, "video": 2, "audio": 4}
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
