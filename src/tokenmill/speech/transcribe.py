"""Transcription of audio of any length: 30 s windows, each prompted with the text before it.

A ``TranscriptionJob`` walks one audio through its windows as OpenAI Whisper's
``transcribe`` does: decode a window (with timestamps), cut it into segments at the
timestamp pairs, seek to the last complete segment's end (or the window's end), and
prompt the next window with the text so far. It is a state machine driven by the
speech engine's callbacks, so many jobs' windows batch into the same decoder steps.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.speech.engine import SpeechEngine, WindowRequest, WindowResult
from tokenmill.speech.mel import FRAMES_PER_SECOND, HOP, SAMPLE_RATE, WINDOW_FRAMES, log_mel
from tokenmill.speech.tokens import TIME_PRECISION, WhisperTokens

COMPRESSION_RATIO_THRESHOLD = 2.4
"""A window whose text compresses better than this repeats itself: decode it again hotter."""
LOGPROB_THRESHOLD = -1.0
"""A window whose mean token log-probability is below this is decoded again hotter."""
NO_SPEECH_THRESHOLD = 0.6
"""A window whose no-speech probability is above this, and whose text is unsure (mean
log-probability below ``LOGPROB_THRESHOLD``), is silence: skipped, no text."""
MAX_PROMPT = 223
"""Previous-text tokens kept in a window's prompt (half the decoder context, minus one)."""


@dataclass(frozen=True)
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    avg_logprob: float
    temperature: float
    compression_ratio: float
    no_speech_prob: float = 0.0


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str
    duration: float
    segments: list[Segment]


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None
    """ISO code (e.g. "en"); None: detected (multilingual models) or English."""
    task: str = "transcribe"
    """transcribe, or translate (into English; multilingual models only)."""
    prompt: str | None = None
    """Text that primes the first window (spelling, style)."""
    temperature: float = 0.0
    """0 is greedy; windows that fail the thresholds are decoded again 0.2 hotter."""
    fallback: bool = True
    """Re-decode failed windows at higher temperatures (up to 1.0)."""
    timestamps: bool = True
    """Decode timestamp tokens (segments); False: one segment per 30 s window."""
    condition_on_previous_text: bool = True
    seed: int = 0
    """Seeds sampling (temperature > 0)."""


@dataclass(frozen=True)
class _Verdict:
    """A decoded window against the thresholds."""

    ratio: float
    avg: float
    silence: bool
    failed: bool


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / max(1, len(zlib.compress(data)))


@dataclass
class TranscriptionJob:
    audio: np.ndarray
    """16 kHz mono float32."""
    options: TranscribeOptions
    engine: SpeechEngine
    future: Future[Transcription] = field(default_factory=Future)
    seek: int = 0
    """Mel frames already transcribed."""
    language: str = "en"
    all_tokens: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    temperature: float = 0.0
    no_speech_prob: float = 0.0
    on_segment: Callable[[Segment], None] | None = None
    """Called (in the speech engine's thread) with each segment as soon as it is final."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    temperatures: dict[int, float] = field(default_factory=dict)
    """Independent-windows mode: the temperature each window was decoded at."""

    def cancel(self) -> None:
        """Stop decoding; the future then fails with ``Cancelled``."""
        self.cancelled.set()

    def __post_init__(self) -> None:
        self.tokens: WhisperTokens = self.engine.loaded.tokens
        self.frames = len(self.audio) // HOP
        self.generator = torch.Generator().manual_seed(self.options.seed)
        opts = self.options
        if opts.prompt:
            self.all_tokens = self.tokens.encode_text(" " + opts.prompt.strip())
        if opts.language is not None:
            self.language = opts.language
        if opts.task not in ("transcribe", "translate"):
            raise ValueError(f"task must be transcribe or translate, got {opts.task!r}")
        if self.tokens.multilingual and self.language not in self.tokens.languages:
            raise ValueError(
                f"unknown language {self.language!r}; known: {sorted(self.tokens.languages)}"
            )
        if not self.tokens.multilingual and opts.language not in (None, "en"):
            raise ValueError(
                f"this Whisper model is English-only; language {opts.language!r} is not supported"
            )

    def start(self) -> Future[Transcription]:
        if self.frames == 0:
            self._finish()
        elif self.tokens.multilingual and self.options.language is None:
            self._submit(self._detect_request())
        else:
            self._begin()
        return self.future

    @property
    def independent_windows(self) -> bool:
        """Without timestamps or previous text every window starts at a multiple of 30 s
        and is prompted alike, so all of them decode at once, batched (one audio's
        windows share each decoder step instead of taking turns)."""
        return not self.options.timestamps and not self.options.condition_on_previous_text

    def _begin(self) -> None:
        if not self.independent_windows:
            return self._next_window()
        n = -(-self.frames // WINDOW_FRAMES)
        self.pending: dict[int, WindowResult | None] = dict.fromkeys(range(n))
        for w in range(n):
            self._submit_window(w, self.options.temperature)

    def _submit_window(self, w: int, temperature: float) -> None:
        """Window ``w`` (frames w * 3000 ...) of the independent-windows mode."""
        prompt = self._prompt() if w == 0 else self._plain_prompt()
        req = WindowRequest(
            self._mel(w * WINDOW_FRAMES), prompt, lambda r: self._on_independent(w, temperature, r),
            timestamps=False, temperature=temperature, max_new_tokens=224,
            generator=self.generator, cancelled=self.cancelled,
        )  # fmt: skip
        self._submit(req)

    def _on_independent(self, w: int, temperature: float, result: WindowResult) -> None:
        try:
            if result.error is not None:
                return self._fail(result.error)
            verdict = self._judge(result)
            if verdict.failed and self.options.fallback and temperature < 1.0 - 1e-6:
                return self._submit_window(w, round(temperature + 0.2, 2))
            self.pending[w] = result
            self.temperatures[w] = temperature
            if all(r is not None for r in self.pending.values()):
                self._merge_independent()
        except Exception as e:  # never leave the caller waiting on a bug
            self._fail(e)

    def _merge_independent(self) -> None:
        """Segments in window order, once every window is decoded."""
        for w, result in sorted(self.pending.items()):
            assert result is not None
            verdict = self._judge(result)
            if verdict.silence:
                continue
            self.seek, self.temperature = w * WINDOW_FRAMES, self.temperatures[w]
            self.no_speech_prob = result.no_speech_prob
            self._cut(result.tokens, verdict.avg, verdict.ratio)
        self._finish()

    def _mel(self, seek: int | None = None) -> torch.Tensor:
        """The 30 s window's features from mel frame ``seek`` (default: ``self.seek``)."""
        begin = (self.seek if seek is None else seek) * HOP
        chunk = torch.from_numpy(self.audio[begin : begin + WINDOW_FRAMES * HOP])
        return log_mel(chunk[None], self.engine.cfg.n_mels)[0]

    def _detect_request(self) -> WindowRequest:
        only = tuple(self.tokens.languages.values())
        return WindowRequest(
            self._mel(), [self.tokens.sot], self._on_language, max_new_tokens=1, only=only,
            cancelled=self.cancelled,
        )  # fmt: skip

    def _on_language(self, result: WindowResult) -> None:
        if result.error is not None:
            return self._fail(result.error)
        by_id = {i: code for code, i in self.tokens.languages.items()}
        self.language = by_id.get(result.tokens[0], "en") if result.tokens else "en"
        self._begin()

    def _plain_prompt(self) -> list[int]:
        sot = self.tokens.sot_sequence(self.language, self.options.task)
        return sot + ([] if self.options.timestamps else [self.tokens.no_timestamps])

    def _prompt(self) -> list[int]:
        prev = self.all_tokens[-MAX_PROMPT:] if self.all_tokens else []
        return ([self.tokens.sot_prev] + prev if prev else []) + self._plain_prompt()

    def _next_window(self, temperature: float | None = None) -> None:
        if self.seek >= self.frames:
            return self._finish()
        self.temperature = self.options.temperature if temperature is None else temperature
        prompt = self._prompt()
        room = self.engine.cfg.max_target_positions - len(prompt)
        req = WindowRequest(
            self._mel(), prompt, self._on_window, timestamps=self.options.timestamps,
            temperature=self.temperature, max_new_tokens=min(224, room), generator=self.generator,
            cancelled=self.cancelled,
        )  # fmt: skip
        self._submit(req)

    def _submit(self, req: WindowRequest) -> None:
        try:
            self.engine.submit(req)
        except Exception as e:
            self._fail(e)

    def _fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def _on_window(self, result: WindowResult) -> None:
        try:
            self._window_done(result)
        except Exception as e:  # never leave the caller waiting on a bug
            self._fail(e)

    def _judge(self, result: WindowResult) -> _Verdict:
        ratio = compression_ratio(self.tokens.decode_text(result.tokens))
        avg = result.sum_logprob / (len(result.tokens) + 1)
        silence = result.no_speech_prob > NO_SPEECH_THRESHOLD and avg < LOGPROB_THRESHOLD
        failed = not silence and (ratio > COMPRESSION_RATIO_THRESHOLD or avg < LOGPROB_THRESHOLD)
        return _Verdict(ratio, avg, silence, failed)

    def _window_done(self, result: WindowResult) -> None:
        if result.error is not None:
            return self._fail(result.error)
        verdict = self._judge(result)
        if verdict.failed and self.options.fallback and self.temperature < 1.0 - 1e-6:
            return self._next_window(round(self.temperature + 0.2, 2))
        if verdict.silence:
            self.seek += min(WINDOW_FRAMES, self.frames - self.seek)  # silence: no segment
            return self._next_window()
        self.no_speech_prob = result.no_speech_prob
        self._cut(result.tokens, verdict.avg, verdict.ratio)
        if not self.options.condition_on_previous_text or self.temperature > 0.5:
            self.all_tokens = []
        self._next_window()

    def _add(self, start: float, end: float, tokens: list[int], avg: float, ratio: float) -> None:
        text = self.tokens.decode_text(tokens)
        if not text.strip():
            return
        seg = Segment(len(self.segments), round(start, 3), round(end, 3), text, tokens, avg,
                      self.temperature, ratio, self.no_speech_prob)  # fmt: skip
        self.segments.append(seg)
        if self.on_segment is not None:
            self.on_segment(seg)
        self.all_tokens.extend(t for t in tokens if t < self.tokens.eot)

    def _cut(self, tokens: list[int], avg: float, ratio: float) -> None:
        """Segments from one decoded window; advances ``seek``."""
        ts = self.tokens.timestamp_begin
        offset = self.seek / FRAMES_PER_SECOND
        size = min(WINDOW_FRAMES, self.frames - self.seek)
        is_ts = [t >= ts for t in tokens]
        single_ending = is_ts[-2:] == [False, True]
        cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        if cuts:
            if single_ending:
                cuts.append(len(tokens))
            last = 0
            for cut in cuts:
                piece = tokens[last:cut]
                start, end = (piece[0] - ts) * TIME_PRECISION, (piece[-1] - ts) * TIME_PRECISION
                self._add(offset + start, offset + end, piece, avg, ratio)
                last = cut
            if single_ending:
                self.seek += size
            else:
                self.seek += (tokens[last - 1] - ts) * 2  # 2 mel frames per timestamp step
            return
        duration = size / FRAMES_PER_SECOND
        stamps = [t for t in tokens if t >= ts]
        if stamps and stamps[-1] != ts:
            duration = (stamps[-1] - ts) * TIME_PRECISION
        self._add(offset, offset + duration, tokens, avg, ratio)
        self.seek += size

    def _finish(self) -> None:
        text = "".join(s.text for s in self.segments).strip()
        duration = len(self.audio) / SAMPLE_RATE
        if not self.future.done():
            self.future.set_result(
                Transcription(text, self.language, duration, list(self.segments))
            )
