"""A ``Transcription`` in OpenAI's response formats: json, text, verbose_json, srt, vtt."""

from __future__ import annotations

from typing import Any

from tokenmill.speech.transcribe import Transcription

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")

_LANGUAGE_NAMES = {
    "en": "english", "de": "german", "es": "spanish", "fr": "french", "it": "italian",
    "pt": "portuguese", "nl": "dutch", "ru": "russian", "zh": "chinese", "ja": "japanese",
    "ko": "korean", "ar": "arabic", "hi": "hindi", "pl": "polish", "tr": "turkish",
    "sv": "swedish", "uk": "ukrainian", "cs": "czech", "el": "greek", "fi": "finnish",
}  # fmt: skip
"""OpenAI's verbose_json names the language in English; others keep their code."""


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(t: Transcription) -> str:
    blocks = [
        f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for i, s in enumerate(t.segments, 1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcription) -> str:
    blocks = [
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in t.segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def to_verbose_json(t: Transcription, task: str) -> dict[str, Any]:
    return {
        "task": task,
        "language": _LANGUAGE_NAMES.get(t.language, t.language),
        "duration": round(t.duration, 3),
        "text": t.text,
        "segments": [
            {
                "id": s.id,
                "seek": round(s.start * 100),
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in t.segments
        ],
        "usage": {"type": "duration", "seconds": round(t.duration, 3)},
    }
