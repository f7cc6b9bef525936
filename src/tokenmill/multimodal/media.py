"""Media from users, loaded safely: images from PIL objects, arrays, bytes and URLs.

Every failure is an ``InvalidRequestError`` (HTTP 400) that says what was wrong: a format
other than PNG / JPEG / WEBP / GIF, a corrupt or truncated file, more pixels than the cap,
a ``file://`` path outside ``allowed_local_media_path`` (``..`` and symlinks are resolved
before the check), an http(s) URL when fetching is off, over the size cap or too slow.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from tokenmill.errors import InvalidRequestError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may come from (server flags; ``LLM.chat`` takes the same options)."""

    allowed_local_media_path: str | None = None
    """``file://`` URLs must resolve inside this folder; None: no local files."""
    allow_http: bool = True
    """Fetch http(s) image URLs (off: refused)."""
    max_bytes: int = 20 << 20
    """Largest encoded media item (data URL, file, or download)."""
    timeout: float = 10.0
    """Seconds for one http(s) fetch."""
    max_pixels: int = 64 << 20
    """Largest decoded image (width x height) accepted before any resize."""


def load_image(obj: Any, max_pixels: int | None = None) -> Any:
    """A PIL image, an [H, W, 3] uint8 array, or encoded bytes -> an RGB PIL image."""
    from PIL import Image

    if isinstance(obj, (bytes, bytearray)):
        return decode_image(bytes(obj), max_pixels)
    if isinstance(obj, Image.Image):
        _check_pixels(obj.width, obj.height, max_pixels)
        return obj.convert("RGB") if obj.mode != "RGB" else obj
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return load_image(Image.fromarray(obj), max_pixels)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"image array could not be read: {e}") from e
    raise InvalidRequestError(
        f"an image must be a PIL image, an array or encoded bytes, got {type(obj).__name__}"
    )


def decode_image(data: bytes, max_pixels: int | None = None) -> Any:
    """Encoded PNG / JPEG / WEBP / GIF bytes -> RGB PIL image, fully decoded (so a
    truncated file fails here, not in the processor)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(f"not an image (or an unsupported format): {e}") from e
    if img.format not in IMAGE_FORMATS:
        raise InvalidRequestError(
            f"image format {img.format} is not accepted; use {', '.join(IMAGE_FORMATS)}"
        )
    _check_pixels(img.width, img.height, max_pixels)
    try:
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidRequestError(f"corrupt or truncated {img.format} image: {e}") from e


def _check_pixels(width: int, height: int, cap: int | None) -> None:
    if cap is not None and width * height > cap:
        raise InvalidRequestError(
            f"image of {width}x{height} = {width * height} pixels is over the cap of {cap} pixels"
        )


def image_from_url(url: str, policy: MediaPolicy) -> Any:
    """``data:image/...;base64,...``, ``file://...`` or ``http(s)://...`` -> RGB PIL image."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    loaders = {"data": _data_url, "file": _file_url, "http": _http_url, "https": _http_url}
    if scheme not in loaders:
        raise InvalidRequestError(
            f"image URL scheme {scheme!r} is not supported; use data:, file:// or http(s)://"
        )
    return decode_image(loaders[scheme](url, policy), policy.max_pixels)


def _data_url(url: str, policy: MediaPolicy) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise InvalidRequestError("a data: URL must be data:<type>;base64,<data>")
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise InvalidRequestError(f"data URL is over the {policy.max_bytes}-byte media cap")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"data URL is not valid base64: {e}") from e


def _file_url(url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(
            "file:// media is off; start the server with --allowed-local-media-path DIR"
        )
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidRequestError("file:// URLs must name a local path")
    path = Path(unquote(parsed.path)).resolve()  # follows symlinks and ``..``
    base = Path(root).resolve()
    if not path.is_relative_to(base):
        raise InvalidRequestError(f"{unquote(parsed.path)} is outside the allowed media path")
    if not path.is_file():
        raise InvalidRequestError(f"{unquote(parsed.path)} is not a file")
    if path.stat().st_size > policy.max_bytes:
        raise InvalidRequestError(f"file is over the {policy.max_bytes}-byte media cap")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read(policy.max_bytes + 1)


def _http_url(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_http:
        raise InvalidRequestError("fetching media over http(s) is off on this server")
    import httpx

    try:
        with httpx.stream("GET", url, timeout=policy.timeout, follow_redirects=True) as r:
            if r.status_code != 200:
                raise InvalidRequestError(f"fetching the image URL gave HTTP {r.status_code}")
            declared = r.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > policy.max_bytes:
                raise InvalidRequestError(
                    f"image URL is over the {policy.max_bytes}-byte media cap"
                )
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > policy.max_bytes:
                    raise InvalidRequestError(
                        f"image URL is over the {policy.max_bytes}-byte media cap"
                    )
            return bytes(data)
    except httpx.TimeoutException as e:
        raise InvalidRequestError(
            f"fetching the image URL timed out after {policy.timeout} s"
        ) from e
    except httpx.HTTPError as e:
        raise InvalidRequestError(f"fetching the image URL failed: {e}") from e


def video_from_url(url: str, policy: MediaPolicy, max_frames: int = 768) -> tuple[list[Any], dict]:
    """A video URL (data:, file://, http(s)) -> (frames [H, W, 3] uint8, {"fps": ...}),
    decoded with PyAV (its own FFmpeg); at most ``max_frames`` frames, each under the
    pixel cap. A corrupt or truncated file, or one with no video stream, is an error."""
    if not isinstance(url, str) or ":" not in url:
        raise InvalidRequestError("video_url.url must be a data:, file:// or http(s):// URL")
    scheme = url.split(":", 1)[0].lower()
    loaders = {"data": _data_url, "file": _file_url, "http": _http_url, "https": _http_url}
    if scheme not in loaders:
        raise InvalidRequestError(f"video URL scheme {scheme!r} is not supported")
    return decode_video(loaders[scheme](url, policy), policy.max_pixels, max_frames)


def decode_video(data: bytes, max_pixels: int | None, max_frames: int) -> tuple[list[Any], dict]:
    try:
        import av
    except ImportError as e:  # pragma: no cover - the multimodal extra installs it
        raise InvalidRequestError("video input needs PyAV (pip install av)") from e
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequestError("the file has no video stream")
            stream = container.streams.video[0]
            _check_pixels(stream.width, stream.height, max_pixels)
            frames = []
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) > max_frames:
                    raise InvalidRequestError(f"video has more than {max_frames} frames")
            fps = float(stream.average_rate) if stream.average_rate else None
    except av.error.FFmpegError as e:
        raise InvalidRequestError(f"corrupt or unsupported video: {e}") from e
    if not frames:
        raise InvalidRequestError("the video has no frames")
    return frames, {"fps": fps} if fps else {}


def audio_from_url(url: str, policy: MediaPolicy) -> tuple[Any, int]:
    """An audio URL (data:, file://, http(s)) -> (mono float32 samples, rate), decoded by
    libsndfile (``speech/audio.decode_audio``: wav, flac, ogg, mp3)."""
    from tokenmill.speech.audio import AudioError, decode_audio

    if not isinstance(url, str) or ":" not in url:
        raise InvalidRequestError("audio_url.url must be a data:, file:// or http(s):// URL")
    scheme = url.split(":", 1)[0].lower()
    loaders = {"data": _data_url, "file": _file_url, "http": _http_url, "https": _http_url}
    if scheme not in loaders:
        raise InvalidRequestError(f"audio URL scheme {scheme!r} is not supported")
    try:
        return decode_audio(loaders[scheme](url, policy))
    except AudioError as e:
        raise InvalidRequestError(str(e)) from e
