"""Media parts of OpenAI-style chat messages -> images, videos + template-ready messages.

Video parts: ``{"type": "video_url", "video_url": {"url": ...}}`` (decoded with PyAV) and
the seeds' ``{"type": "video", "video": frames | url}``. Accepted image parts: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as
a string), the seeds' ``{"type": "image", "image": ...}`` (a URL, bytes or PIL image) and
``{"type": "image_pil", "image_pil": PIL}``. Each becomes ``{"type": "image"}`` for the
chat template (Qwen-VL's writes one placeholder per such part) and its image is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.media import MediaPolicy, image_from_url, load_image, video_from_url

IMAGE_PARTS = ("image_url", "image", "image_pil")
VIDEO_PARTS = ("video_url", "video")
UNSUPPORTED_PARTS = ("input_audio", "audio_url", "audio")


def has_media(messages: list[dict]) -> bool:
    return any(_part_type(p) in IMAGE_PARTS + VIDEO_PARTS + UNSUPPORTED_PARTS
               for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), list)
               for p in m["content"])  # fmt: skip


def extract_media(
    messages: list[dict], policy: MediaPolicy
) -> tuple[list[dict], dict[str, list[Any]]]:
    """(messages with media parts as {"type": "image"} / {"type": "video"}, the decoded
    {"image": [...], "video": [...]} in order)."""
    media: dict[str, list[Any]] = {"image": [], "video": []}
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
                    f"content part type {kind!r} is not supported yet; send images or video"
                )
            if kind in IMAGE_PARTS:
                media["image"].append(_load_part(part, kind, policy))
                parts.append({"type": "image"})
            elif kind in VIDEO_PARTS:
                media["video"].append(_load_video(part, kind, policy))
                parts.append({"type": "video"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, {k: v for k, v in media.items() if v}


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


def _load_video(part: Mapping[str, Any], kind: str, policy: MediaPolicy) -> Any:
    value = part.get(kind)
    if kind == "video_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequestError(f"a {kind!r} content part needs its {kind!r} field")
    if isinstance(value, str):
        return video_from_url(value, policy)
    return value  # frames or (frames, metadata), as multi_modal_data takes them
