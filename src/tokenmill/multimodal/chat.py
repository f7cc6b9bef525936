"""Media parts of OpenAI-style chat messages -> images, videos + template-ready messages.

Video parts: ``{"type": "video_url", "video_url": {"url": ...}}`` (decoded with PyAV) and
the seeds' ``{"type": "video", "video": frames | url}``; audio parts: ``input_audio``
(base64 wav / mp3 / flac), ``audio_url`` and the seeds' ``audio`` (libsndfile). Accepted image parts: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as
a string), the seeds' ``{"type": "image", "image": ...}`` (a URL, bytes or PIL image) and
``{"type": "image_pil", "image_pil": PIL}``. Each becomes ``{"type": "image"}`` for the
chat template (Qwen-VL's writes one placeholder per such part) and its image is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.media import (
    MediaPolicy,
    audio_from_url,
    image_from_url,
    load_image,
    video_from_url,
)

IMAGE_PARTS = ("image_url", "image", "image_pil")
VIDEO_PARTS = ("video_url", "video")
AUDIO_PARTS = ("input_audio", "audio_url", "audio")


def has_media(messages: list[dict]) -> bool:
    return any(_part_type(p) in IMAGE_PARTS + VIDEO_PARTS + AUDIO_PARTS
               for m in messages if isinstance(m, Mapping) and isinstance(m.get("content"), list)
               for p in m["content"])  # fmt: skip


def extract_media(
    messages: list[dict], policy: MediaPolicy
) -> tuple[list[dict], dict[str, list[Any]]]:
    """(messages with media parts as {"type": "image"} / {"type": "video"}, the decoded
    {"image": [...], "video": [...]} in order)."""
    media: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = _part_type(part)
            if kind in IMAGE_PARTS:
                media["image"].append(_load_part(part, kind, policy))
                parts.append({"type": "image"})
            elif kind in VIDEO_PARTS:
                media["video"].append(_load_video(part, kind, policy))
                parts.append({"type": "video"})
            elif kind in AUDIO_PARTS:  # Qwen2-Audio's template tests for an "audio" key
                media["audio"].append(_load_audio(part, kind, policy))
                parts.append({"type": "audio", "audio": "audio"})
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


def _load_audio(part: Mapping[str, Any], kind: str, policy: MediaPolicy) -> Any:
    """``input_audio`` {data: base64, format}, ``audio_url`` {url} or the seeds' ``audio``
    (a URL, or (samples, rate)) -> (samples, rate)."""
    value = part.get(kind)
    if value is None:
        raise InvalidRequestError(f"a {kind!r} content part needs its {kind!r} field")
    if kind == "input_audio":
        if not isinstance(value, Mapping) or not isinstance(value.get("data"), str):
            raise InvalidRequestError(
                "input_audio needs {'data': <base64>, 'format': 'wav' | 'mp3' | 'flac'}"
            )
        return audio_from_url("data:audio/x;base64," + value["data"], policy)
    if kind == "audio_url" and isinstance(value, Mapping):
        value = value.get("url")
    if isinstance(value, str):
        return audio_from_url(value, policy)
    return value
