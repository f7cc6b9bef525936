"""The offline API: ``Transcriber(folder).transcribe(audio)``, batched across calls and threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.speech.audio import load_audio
from tokenmill.speech.engine import SpeechEngine
from tokenmill.speech.loader import load_whisper
from tokenmill.speech.transcribe import Segment, TranscribeOptions, Transcription, TranscriptionJob
from tokenmill.threads import release_openmp_threads

AudioInput = bytes | np.ndarray | tuple[np.ndarray, int]
"""File bytes, (samples, rate), or 16 kHz samples."""


class Transcriber:
    """Whisper from a CTranslate2 or HF folder; every transcription shares one speech engine."""

    def __init__(
        self, folder: str | Path, max_batch: int = 16, dtype: torch.dtype = torch.float32
    ) -> None:
        self.folder = Path(folder)
        self.loaded = load_whisper(folder, dtype)
        self.engine = SpeechEngine(self.loaded, max_rows=max_batch)

    @property
    def multilingual(self) -> bool:
        return self.loaded.tokens.multilingual

    def start(
        self,
        audio: AudioInput,
        options: TranscribeOptions | None = None,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> TranscriptionJob:
        """Start one transcription; ``job.future`` resolves when its last window is decoded.
        This thread decodes the audio and computes the first windows' features, then lets
        go of its OpenMP threads: the engine thread computes (``tokenmill.threads``)."""
        try:
            samples = load_audio(audio)
            opts = options or TranscribeOptions()
            job = TranscriptionJob(samples, opts, self.engine, on_segment=on_segment)
            job.start()
            return job
        finally:
            release_openmp_threads()

    def submit(
        self, audio: AudioInput, options: TranscribeOptions | None = None
    ) -> Future[Transcription]:
        return self.start(audio, options).future

    def transcribe(
        self, audio: AudioInput, language: str | None = None, **options: Any
    ) -> Transcription:
        """``options``: the fields of ``TranscribeOptions`` (task, prompt, temperature, ...)."""
        return self.submit(audio, TranscribeOptions(language=language, **options)).result()

    def transcribe_batch(
        self, audios: Sequence[AudioInput], language: str | None = None, **options: Any
    ) -> list[Transcription]:
        """Many at once: their windows batch into the same decoder steps."""
        base = TranscribeOptions(language=language, **options)
        futures = [self.submit(a, replace(base)) for a in audios]
        return [f.result() for f in futures]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Transcriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
