"""Speech beside the text engine: Whisper transcription and Piper text-to-speech.

Heavy modules load on first use (``import tokenmill`` stays cheap).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Transcriber": "tokenmill.speech.transcriber",
    "TranscribeOptions": "tokenmill.speech.transcribe",
    "Transcription": "tokenmill.speech.transcribe",
    "Segment": "tokenmill.speech.transcribe",
    "is_whisper_folder": "tokenmill.speech.loader",
    "load_whisper": "tokenmill.speech.loader",
    "ct2_to_hf": "tokenmill.speech.convert",
    "is_speech_model": "tokenmill.speech.detect",
    "piper_voice_file": "tokenmill.speech.detect",
    "load_model": "tokenmill.speech.runtime",
    "TTS": "tokenmill.speech.tts",
    "AudioParams": "tokenmill.speech.tts",
    "load_piper": "tokenmill.speech.piper",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill.speech' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
