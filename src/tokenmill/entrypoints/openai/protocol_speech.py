"""What the speech routes share: OpenAI's names, limits, metrics, the loaded runtimes and the
/v1/audio/speech body."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from tokenmill.entrypoints.openai.errors import APIError, bad_request

ASR_ALIASES = frozenset({"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"})
"""OpenAI's model names, accepted for the served Whisper so that clients work unchanged."""
TTS_ALIASES = frozenset({"tts-1", "tts-1-hd", "gpt-4o-mini-tts"})


@dataclass(frozen=True)
class SpeechLimits:
    max_file_bytes: int = 25 * 1024 * 1024
    """Largest audio upload (OpenAI's limit); larger is a 400 before decoding."""
    max_audio_seconds: float = 3600.0
    """Longest audio one transcription may hold."""
    max_live_requests: int = 64
    """Speech requests in flight beyond this get 429."""
    max_input_chars: int = 4096
    """Longest text for /v1/audio/speech (OpenAI's limit)."""


class SpeechMeter:
    """Prometheus metrics of the speech routes (``GET /metrics``), in their own registry."""

    def __init__(self, model_name: str, live: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self.requests = Counter("tokenmill:speech_requests", "Speech requests answered (200)",
                                ["endpoint"], registry=self.registry).labels  # fmt: skip
        self.audio = Counter("tokenmill:speech_audio_seconds", "Seconds of audio transcribed (in) "
                             "or spoken (out)", ["direction"], registry=self.registry).labels  # fmt: skip
        self.latency = Histogram("tokenmill:speech_request_seconds", "Time to a transcription, or to "
                                 "the first audio chunk", ["endpoint"], registry=self.registry,
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)).labels  # fmt: skip
        gauge = Gauge("tokenmill:speech_live_requests", "Speech requests in flight",
                      list(labels), registry=self.registry)  # fmt: skip
        gauge.labels(**labels).set_function(live)


@dataclass
class SpeechState:
    model_name: str
    transcriber: Any = None
    """A ``tokenmill.speech.Transcriber``, or None when the model speaks instead."""
    tts: Any = None
    """A ``tokenmill.speech.TTS``, or None."""
    limits: SpeechLimits = field(default_factory=SpeechLimits)
    live: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    meter: SpeechMeter = field(init=False)

    def __post_init__(self) -> None:
        self.meter = SpeechMeter(self.model_name, lambda: self.live)

    def check_model(self, name: str | None, aliases: frozenset[str]) -> None:
        if not name:
            raise bad_request(f"model is required: send model={self.model_name!r}", param="model")
        if name != self.model_name and name not in aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", type="not_found_error", param="model",
                           code="model_not_found")  # fmt: skip

    @contextlib.contextmanager
    def admitted(self) -> Any:
        if self.live >= self.limits.max_live_requests:
            raise APIError(429, f"{self.live} speech requests are in flight (the limit); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        self.live += 1
        try:
            yield
        finally:
            self.live -= 1


class SpeechRequest(BaseModel):
    """OpenAI's /v1/audio/speech body."""

    model: str
    input: str
    voice: str = "default"
    response_format: str = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: str = "audio"
    instructions: str | None = None
    """Accepted and ignored (Piper voices take no style prompt)."""


SPEECH_FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac",
                  "mp3": "audio/mpeg", "opus": "audio/ogg"}  # fmt: skip
"""Formats /v1/audio/speech writes (mp3, flac and opus through libsndfile); aac is a 400."""
