"""The offline text-to-speech API: ``TTS(model).generate_speech_stream(text, AudioParams())``."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tokenmill.speech.espeak import phonemize
from tokenmill.speech.piper import load_piper

DEFAULT_VOICE = "default"
"""A single-voice model answers to its own voice name and to this."""


@dataclass(frozen=True)
class AudioParams:
    voice: str = DEFAULT_VOICE
    """A name from ``list_voices()``, or "default"."""
    speed: float = 1.0
    """Speaking rate, 0.25 .. 4.0 (OpenAI's range); divides the voice's length scale."""
    seed: int | None = 0
    """Seeds the voice's noise (None: a fresh draw each call)."""

    def __post_init__(self) -> None:
        if not 0.25 <= self.speed <= 4.0:
            raise ValueError(f"speed must be in [0.25, 4.0], got {self.speed}")


def split_sentences(text: str) -> list[str]:
    """Sentences (end punctuation then space); each is synthesized and streamed on its own."""
    parts = re.split(r"(?<=[.!?;:])\s+|\n+", text.strip())
    return [p.strip() for p in parts if p.strip()]


def to_pcm16(audio: torch.Tensor) -> bytes:
    """[-1, 1] float -> int16 little-endian bytes."""
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


class TTS:
    """A Piper voice (its folder or its ``.onnx``); ``generate_speech_stream`` is thread-safe."""

    def __init__(self, model: str | Path, warmup: bool = True) -> None:
        self.voice = load_piper(model)
        self._lock = threading.Lock()
        self._closed = False
        if warmup:  # the first forward pays oneDNN's setup (seconds): not the first request
            self.synthesize("Hello.")

    @property
    def sample_rate(self) -> int:
        return self.voice.sample_rate

    def list_voices(self) -> list[str]:
        return [self.voice.name]

    def _check(self, params: AudioParams) -> None:
        if self._closed:
            raise RuntimeError("this TTS was closed")
        if params.voice not in (self.voice.name, DEFAULT_VOICE):
            raise ValueError(
                f"unknown voice {params.voice!r}; known voices: {self.list_voices()} (or 'default')"
            )

    def synthesize(self, sentence: str, params: AudioParams = AudioParams()) -> torch.Tensor:
        """One sentence -> float waveform [samples] at ``sample_rate``."""
        self._check(params)
        ids = self.voice.ids(phonemize(sentence, self.voice.espeak_voice))
        base = self.voice.scales
        scales = replace(base, length=base.length / params.speed)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        with self._lock, torch.inference_mode():
            return self.voice.model(torch.tensor([ids]), scales, gen)

    def generate_speech_stream(
        self, text: str, params: AudioParams = AudioParams()
    ) -> Iterator[bytes]:
        """int16 LE mono PCM chunks as soon as each is synthesized (sentence by sentence,
        each sentence in vocoder pieces)."""
        self._check(params)
        sentences = split_sentences(text)
        if not sentences:
            raise ValueError("the input text is empty")
        for sentence in sentences:
            yield from self._sentence_chunks(sentence, params)

    def _sentence_chunks(self, sentence: str, params: AudioParams) -> Iterator[bytes]:
        """A sentence's PCM in pieces: the vocoder runs on frame windows, so the first piece
        is out before the rest of the sentence is decoded."""
        ids = self.voice.ids(phonemize(sentence, self.voice.espeak_voice))
        base = self.voice.scales
        scales = replace(base, length=base.length / params.speed)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        model = self.voice.model
        with self._lock, torch.inference_mode():
            z = model.latent(torch.tensor([ids]), scales, gen)
        pieces = model.decode_chunks(z)
        while True:
            with self._lock, torch.inference_mode():
                piece = next(pieces, None)
            if piece is None:
                return
            yield to_pcm16(piece)

    def generate_speech(self, text: str, params: AudioParams = AudioParams()) -> np.ndarray:
        """The whole text as int16 samples."""
        pcm = b"".join(self.generate_speech_stream(text, params))
        return np.frombuffer(pcm, dtype="<i2")

    def close(self) -> None:
        self._closed = True
