"""The offline text-to-speech API: ``TTS(model).generate_speech_stream(text, AudioParams())``."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.speech.espeak import phonemize, phonemize_sentences
from tokenmill.speech.piper import load_piper
from tokenmill.speech.vits import Piece, pieces
from tokenmill.speech.workers import TaskPool
from tokenmill.threads import release_openmp_threads

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


def to_pcm16(audio: torch.Tensor) -> bytes:
    """[-1, 1] float -> int16 little-endian bytes."""
    return (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()


AHEAD = 3
"""Sentences of a stream whose latents may be computed before the listener reaches them."""
FIRST = 24
"""Latent frames in a stream's first piece (0.28 s of audio): out soon, decoded fast."""
GROWTH = 2
"""After the first piece, the first sentence's pieces double (24, 48, 96, 192 frames)
until ``PIECE``: each is decoded while the one before plays, so the stream does not stall
after its first 0.28 s (one 300-frame piece after it was heard ~0.3 s late on one quiet
core); later sentences are computed ahead and need no ramp."""
PIECE = 512
"""At most this many latent frames (6 s) in a vocoder piece after the first."""
LAST_PARTS = 2
"""The last sentence's pieces (no next sentence's latent to overlap it: each to a worker);
a constant, so that the bytes depend on the text only."""


class TTS:
    """A Piper voice (its folder or its ``.onnx``); ``generate_speech_stream`` is thread-safe.

    The model runs on ``workers`` single-threaded workers (default: torch's thread count):
    a stream's sentence latents and vocoder pieces are tasks, the earliest audio first, so
    the next sentences are computed while the current one is decoded.
    """

    def __init__(self, model: str | Path, warmup: bool = True, workers: int | None = None) -> None:
        self.voice = load_piper(model)
        self.workers = workers or torch.get_num_threads()
        self._pool = TaskPool(self.workers)
        self._streams = itertools.count()
        self._closed = False
        if warmup:  # the first forward pays oneDNN's setup (seconds): not the first request
            self.generate_speech("Hello.")
        # the workers compute: loading here must not leave OpenMP workers to throttle them
        # or a Whisper engine thread beside this voice (tokenmill.threads)
        release_openmp_threads()

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

    def _prior(self, phonemes: str, params: AudioParams) -> torch.Tensor:
        """One sentence's phonemes -> the flows' input [1, inter, frames] (``Vits.prior``)."""
        ids = self.voice.ids(phonemes)
        base = self.voice.scales
        scales = replace(base, length=base.length / params.speed)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return self.voice.model.prior(torch.tensor([ids]), scales, gen)

    def synthesize(self, sentence: str, params: AudioParams = AudioParams()) -> torch.Tensor:
        """One sentence -> float waveform [samples] at ``sample_rate``, in one piece."""
        self._check(params)

        def run() -> torch.Tensor:
            model = self.voice.model
            phonemes = phonemize(sentence, self.voice.espeak_voice)
            return model.dec(model.flows(self._prior(phonemes, params)))[0, 0]

        return self._pool.submit((next(self._streams),), run).result()  # type: ignore[no-any-return]

    def generate_speech_stream(
        self, text: str, params: AudioParams = AudioParams()
    ) -> Iterator[bytes]:
        """int16 LE mono PCM chunks in order, each as soon as it is synthesized: sentence
        by sentence (espeak-ng's sentences, split as piper-tts splits them: an abbreviation's
        full stop or a semicolon ends none), the first one's first ``FIRST`` frames on their
        own (the same bytes whatever the timing and the workers: the pieces depend on the
        text only)."""
        self._check(params)
        sentences = phonemize_sentences(text, self.voice.espeak_voice)
        if not sentences:
            raise ValueError("the input text is empty")
        stream = _Stream(self, next(self._streams), sentences, params)
        try:
            yield from stream.chunks()
        finally:
            stream.cancel()

    def generate_speech(self, text: str, params: AudioParams = AudioParams()) -> np.ndarray:
        """The whole text as int16 samples."""
        pcm = b"".join(self.generate_speech_stream(text, params))
        return np.frombuffer(pcm, dtype="<i2")

    def close(self) -> None:
        self._closed = True
        self._pool.close()


class _Stream:
    """One ``generate_speech_stream`` call's tasks, keyed (stream, sentence, step): step 0
    computes a sentence's prior sample, then its flows and pieces follow. The first
    sentence's first piece goes through the flows on its own frames (and their context),
    while another worker maps the whole sentence: the first audio waits for neither. The
    next ``AHEAD`` sentences start when the first one's prior is done (their priors on the
    other worker competed with it for the cores).

    A task returns PCM bytes or, in order, the futures of the tasks it submitted."""

    def __init__(self, tts: TTS, sid: int, sentences: list[str], params: AudioParams) -> None:
        self.tts, self.sid, self.sentences, self.params = tts, sid, sentences, params
        self.futures: list[Future[Any]] = []
        self.started: dict[int, Future[Any]] = {}  # sentence -> its step-0 task
        self.lock = threading.Lock()
        self.stopped = False

    def chunks(self) -> Iterator[bytes]:
        n = len(self.sentences)
        self._start(0)  # sentences 1 .. AHEAD start once its prior is known (``_sentence``)
        for i in range(n):
            if 0 < i and i + AHEAD < n:
                self._start(i + AHEAD)
            yield from _drain(self.started[i])  # present: started before i - 1 finished

    def _start(self, i: int) -> None:
        for future in self._submit(i, [(0, partial(self._sentence, i))]):  # none if stopped
            self.started[i] = future

    def _submit(self, i: int, tasks: list[tuple[int, Callable[[], Any]]]) -> list[Future[Any]]:
        """Sentence ``i``'s (step, fn) tasks; none once the stream is cancelled."""
        with self.lock:
            if self.stopped:
                return []
            out = [self.tts._pool.submit((self.sid, i, step), fn) for step, fn in tasks]
            self.futures += out
        return out

    def _sentence(self, i: int) -> list[Future[Any]]:
        model = self.tts.voice.model
        zp = self.tts._prior(self.sentences[i], self.params)
        if i == 0:  # not before: on shared cores the next priors slowed the first chunk 2x
            for j in range(1, min(AHEAD + 1, len(self.sentences))):
                self._start(j)
        parts = LAST_PARTS if i == len(self.sentences) - 1 else 1
        first, growth = (FIRST, GROWTH) if i == 0 else (0, 1)
        plan = pieces(zp.shape[2], first, PIECE, parts, growth)
        if i == 0 and len(plan) > 1:
            head = plan[0]
            return self._submit(i, [
                (1, lambda: self._decode(model.flows(zp, head.hi), head)),
                (2, lambda: self._pieces(i, model.flows(zp), plan[1:], 3)),
            ])  # fmt: skip
        return self._pieces(i, model.flows(zp), plan, 1)

    def _pieces(self, i: int, z: torch.Tensor, plan: list[Piece], step: int) -> list[Future[Any]]:
        return self._submit(
            i, [(step + j, partial(self._decode, z, p)) for j, p in enumerate(plan)]
        )

    def _decode(self, z: torch.Tensor, piece: Piece) -> bytes:
        return to_pcm16(self.tts.voice.model.decode_piece(z, piece))

    def cancel(self) -> None:
        """The tasks not started yet are dropped (the running ones finish)."""
        with self.lock:
            self.stopped = True
            for future in self.futures:
                future.cancel()


def _drain(future: Future[Any]) -> Iterator[bytes]:
    """A task's PCM: its bytes, or those of the tasks it submitted, in order."""
    result = future.result()
    if isinstance(result, bytes):
        yield result
        return
    for f in result:
        yield from _drain(f)
