"""``LLM(whisper_folder)``: transcription through the offline API, in vLLM's two forms.

    llm = LLM("path/to/whisper")          # a CTranslate2 or HF Whisper folder
    llm.transcribe(audio, language="en")   # -> Transcription (text, segments, language)
    llm.generate({"prompt": "<|startoftranscript|><|en|><|transcribe|>",
                  "multi_modal_data": {"audio": (samples, rate)}})   # -> [RequestOutput]

The ``LLM`` holds a ``Transcriber`` (``speech/``: its own batched engine) instead of the
text engine. A prompt's Whisper control tokens choose the language and the task; the rest
of its text primes the first window. A Piper voice is refused with what to use instead.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.speech.transcribe import Transcription
    from tokenmill.speech.transcriber import AudioInput, Transcriber

_CONTROL = re.compile(r"<\|([a-z_]+)\|>")
_TASKS = {"transcribe", "translate"}
_IGNORED = {"startoftranscript", "notimestamps", "endoftext", "startofprev", "nocaptions"}


class SpeechMixin:
    """The speech half of ``LLM`` (``_load_speech`` decides at construction)."""

    transcriber: Transcriber | None = None

    def _load_speech(self, config: EngineConfig) -> bool:
        """Load a Whisper folder as a Transcriber; False for anything else."""
        if config.model is None:
            return False
        from tokenmill.speech.detect import is_speech_model

        kind = is_speech_model(config.model)
        if kind is None:
            return False
        if kind == "tts":
            raise InvalidRequestError(
                f"{config.model} is a text-to-speech voice, not a language model: load it with "
                "tokenmill.TTS(path) or tokenmill.load_model(path)"
            )
        from tokenmill.speech.transcriber import Transcriber

        self.transcriber = Transcriber(config.model)
        return True

    def transcribe(
        self, audio: AudioInput, language: str | None = None, **options: Any
    ) -> Transcription:
        """Transcribe audio (file bytes, (samples, rate), or 16 kHz samples); ``options``:
        ``TranscribeOptions`` fields (task, prompt, temperature, timestamps...)."""
        return self._speech("transcribe").transcribe(audio, language, **options)

    def _speech(self, what: str) -> Transcriber:
        if self.transcriber is None:
            raise InvalidRequestError(
                f"{what}() needs a Whisper model (a CTranslate2 or HF Whisper folder); this "
                "LLM holds a text model"
            )
        return self.transcriber

    def _generate_speech(
        self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[RequestOutput]:
        """vLLM's form: each prompt a dict with "prompt" (Whisper control tokens and
        priming text) and "multi_modal_data": {"audio": (samples, rate)}; all transcribed
        at once (their windows share decoder steps)."""
        from tokenmill.speech.transcribe import TranscribeOptions

        transcriber = self._speech("generate")
        items = [prompts] if isinstance(prompts, dict) else list(prompts)
        per = list(params) if isinstance(params, Sequence) else [params] * len(items)
        if len(per) != len(items):
            raise InvalidRequestError(
                f"got {len(per)} sampling params for {len(items)} prompts: pass one or one each"
            )
        jobs = []
        for item, p in zip(items, per):
            audio, text = _audio_prompt(item)
            language, task, priming = _controls(text)
            opts = TranscribeOptions(
                language=language, task=task, prompt=priming or None,
                temperature=p.temperature if p is not None else 0.0,
            )  # fmt: skip
            jobs.append((text, transcriber.submit(audio, opts)))
        outputs = []
        for text, future in jobs:
            result = future.result()
            tokens = [t for seg in result.segments for t in seg.tokens]
            completion = CompletionOutput(0, result.text, tokens, finish_reason="stop")
            outputs.append(RequestOutput(uuid.uuid4().hex, text, [], [completion], True))
        return outputs

    def _close_speech(self) -> None:
        transcriber, self.transcriber = self.transcriber, None
        if transcriber is not None:
            transcriber.close()


def _audio_prompt(item: Any) -> tuple[Any, str]:
    """(audio, prompt text) of one prompt, or a ValueError saying what to pass."""
    data = item.get("multi_modal_data") if isinstance(item, dict) else None
    audio = data.get("audio") if isinstance(data, dict) else None
    if audio is None:
        raise InvalidRequestError(
            'a Whisper model transcribes audio: pass {"prompt": "<|startoftranscript|>", '
            '"multi_modal_data": {"audio": (samples, sample_rate)}} or call llm.transcribe(audio)'
        )
    prompt = item.get("prompt") or ""
    if not isinstance(prompt, str):
        raise InvalidRequestError("a Whisper prompt is text (its control tokens and priming)")
    return audio, prompt


def _controls(text: str) -> tuple[str | None, str, str]:
    """(language, task, priming text) from a prompt's Whisper control tokens."""
    language, task = None, "transcribe"
    for name in _CONTROL.findall(text):
        if name in _TASKS:
            task = name
        elif name not in _IGNORED:
            language = name
    return language, task, _CONTROL.sub("", text).strip()
