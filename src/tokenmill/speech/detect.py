"""What kind of speech checkpoint a path holds (no weights are read)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.speech.loader import is_whisper_folder


def piper_voice_file(path: str | Path) -> Path | None:
    """The ``.onnx`` of a Piper voice: the file itself (with its ``.onnx.json`` beside it), or
    the only such pair in a folder; None when ``path`` is not one."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".onnx" and p.with_suffix(".onnx.json").is_file() else None
    if p.is_dir():
        pairs = [f for f in sorted(p.glob("*.onnx")) if f.with_suffix(".onnx.json").is_file()]
        return pairs[0] if len(pairs) == 1 else None
    return None


def is_speech_model(path: str | Path) -> str | None:
    """ "whisper" (a Whisper folder), "tts" (a Piper voice) or None (for the text engine)."""
    if is_whisper_folder(path):
        return "whisper"
    if piper_voice_file(path) is not None:
        return "tts"
    return None
