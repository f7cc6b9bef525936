"""Media parts of OpenAI-style chat messages -> images + template-ready messages.

Accepted image parts: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as
a string), the seeds' ``{"type": "image", "image": ...}`` (a URL, bytes or PIL image) and
``{"type": "image_pil", "image_pil": PIL}``. Each becomes ``{"type": "image"}`` for the
chat template (Qwen-VL's writes one placeholder per such part) and its image is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.media import MediaPolicy, image_from_url, load_image

IMAGE_PARTS = ("image_url", "image", "image_pil")
UNSUPPORTED_PARTS = ("input_audio", "audio_url", "audio", "video_url", "video")


def has_media(messages: list[dict]) -> bool:
    return any(_part_type(p) in IMAGE_PARTS + UNSUPPORTED_PARTS
               for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), list)
               for p in m["content"])  # fmt: skip


def extract_images(messages: list[dict], policy: MediaPolicy) -> tuple[list[dict], list[Any]]:
    """(messages with image parts as {"type": "image"}, the images in order)."""
    images: list[Any] = []
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = _part_type(part)
            if kind in UNSUPPORTED_PARTS:
                raise InvalidRequestError(
                    f"content part type {kind!r} is not supported yet; send images"
                )
            if kind in IMAGE_PARTS:
                images.append(_load_part(part, kind, policy))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, images


def _part_type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, Mapping) else None


def _load_part(part: Mapping[str, Any], kind: str, policy: MediaPolicy) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"a {kind!r} content part needs its {kind!r} field")
    if isinstance(value, str):
        return image_from_url(value, policy)
    return load_image(value, policy.max_pixels)
