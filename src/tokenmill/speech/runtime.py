"""``load_model``: the runtime a checkpoint needs (TTS, Transcriber or the text engine's LLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.speech.detect import is_speech_model


def load_model(model: str | Path, **kwargs: Any) -> Any:
    """The runtime a checkpoint needs: ``TTS`` for a Piper voice, ``Transcriber`` for Whisper,
    else ``LLM(model, **kwargs)`` (the text engine)."""
    kind = is_speech_model(model)
    if kind == "tts":
        from tokenmill.speech.tts import TTS

        return TTS(model, **kwargs)
    if kind == "whisper":
        from tokenmill.speech.transcriber import Transcriber

        return Transcriber(model, **kwargs)
    from tokenmill.llm import LLM

    return LLM(str(model), **kwargs)
