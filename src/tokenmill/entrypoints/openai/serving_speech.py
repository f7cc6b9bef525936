"""OpenAI's audio routes over the speech runtimes (``tokenmill.speech``), beside the text server.

``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart form) run on a
``Transcriber``; ``/v1/audio/speech`` and ``GET /v1/audio/voices`` on a ``TTS``. A speech
model is served by its own small app (``build_speech_app``): the text app's body
middleware takes JSON only, and the two runtimes share no engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import FormData, UploadFile

from tokenmill import __version__
from tokenmill.entrypoints.openai.errors import APIError, bad_request, install_handlers
from tokenmill.entrypoints.openai.protocol_speech import (
    ASR_ALIASES,
    SPEECH_FORMATS,
    TTS_ALIASES,
    SpeechLimits,
    SpeechMeter,
    SpeechRequest,
    SpeechState,
)
from tokenmill.entrypoints.openai.state import ServerConfig

logger = logging.getLogger(__name__)


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None or isinstance(value, UploadFile):
        return None
    return str(value).strip() or None


def _float(form: FormData, name: str, default: float, low: float, high: float) -> float:
    text = _field(form, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise bad_request(f"{name} must be a number, got {text!r}", param=name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


async def _read_file(form: FormData, limits: SpeechLimits) -> bytes:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request(
            "file is required: send the audio as the multipart field 'file'", param="file"
        )
    data = await upload.read(limits.max_file_bytes + 1)
    if len(data) > limits.max_file_bytes:
        raise bad_request(f"the audio file is over {limits.max_file_bytes} bytes", param="file",
                          code="file_too_large")  # fmt: skip
    return data


class _ClientGone(Exception):
    pass


async def _until_done(job: Any, raw: Request) -> Any:
    """The job's result; a client that leaves cancels the job (and gets no answer)."""
    result = asyncio.wrap_future(job.future)
    while True:
        done, _ = await asyncio.wait({result}, timeout=0.5)
        if done:
            return result.result()
        if await raw.is_disconnected():
            job.cancel()
            raise _ClientGone


async def _form(raw: Request, limits: SpeechLimits) -> FormData:
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_file_bytes + 65536:
        raise bad_request(f"the request body is over {limits.max_file_bytes} bytes",
                          param="file", code="file_too_large")  # fmt: skip
    kind = raw.headers.get("content-type", "")
    if not kind.startswith("multipart/form-data"):
        raise bad_request(f"send a multipart/form-data body (Content-Type is {kind!r})")
    try:
        return await raw.form(max_files=1, max_fields=64)
    except Exception as e:  # malformed multipart
        raise bad_request(f"the multipart body could not be read: {e}") from e


class TranscriptionHandler:
    def __init__(self, state: SpeechState) -> None:
        self.state = state

    async def create(self, raw: Request, task: str) -> Response:
        from tokenmill.speech.audio import load_audio
        from tokenmill.speech.formats import RESPONSE_FORMATS
        from tokenmill.speech.transcribe import TranscribeOptions
        from tokenmill.threads import then_release

        st = self.state
        if st.transcriber is None:
            raise APIError(404, f"{st.model_name!r} is a text-to-speech model: it does not transcribe",
                           type="not_found_error", code="model_not_found")  # fmt: skip
        form = await _form(raw, st.limits)
        st.check_model(_field(form, "model"), ASR_ALIASES)
        fmt = _field(form, "response_format") or "json"
        if fmt not in RESPONSE_FORMATS:
            raise bad_request(f"response_format must be one of {list(RESPONSE_FORMATS)}, got {fmt!r}",
                              param="response_format")  # fmt: skip
        grains = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
        if any(g not in ("segment", "word") for g in grains):
            raise bad_request(f"timestamp_granularities must be segment or word, got {grains}",
                              param="timestamp_granularities[]")  # fmt: skip
        if "word" in grains:
            raise bad_request("word timestamps are not supported; use 'segment'",
                              param="timestamp_granularities[]")  # fmt: skip
        stream = (_field(form, "stream") or "false").lower() == "true"
        language = _field(form, "language") if task == "transcribe" else None
        options = TranscribeOptions(
            language=language.lower() if language else None, task=task, prompt=_field(form, "prompt"),
            temperature=_float(form, "temperature", 0.0, 0.0, 1.0),
        )  # fmt: skip
        data = await _read_file(form, st.limits)
        started = time.perf_counter()
        with st.admitted():
            samples = await asyncio.to_thread(then_release, load_audio, data)
            seconds = len(samples) / 16000
            if seconds > st.limits.max_audio_seconds:
                raise bad_request(f"the audio is {seconds:.0f} s long; the limit is "
                                  f"{st.limits.max_audio_seconds:.0f} s", param="file",
                                  code="audio_too_long")  # fmt: skip
            if stream:
                return await self._stream(raw, samples, options)
            job = await asyncio.to_thread(st.transcriber.start, samples, options)
            try:
                result = await _until_done(job, raw)
            except _ClientGone:
                return Response(status_code=499)  # nobody reads it
        endpoint = "transcriptions" if task == "transcribe" else "translations"
        st.meter.requests(endpoint).inc()
        st.meter.audio("in").inc(result.duration)
        st.meter.latency(endpoint).observe(time.perf_counter() - started)
        return _render(result, fmt, task)

    async def _stream(self, raw: Request, samples: Any, options: Any) -> Response:
        """SSE: a transcript.text.delta per segment as it is final, then transcript.text.done."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_segment(seg: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, seg.text)

        job = await asyncio.to_thread(self.state.transcriber.start, samples, options, on_segment)
        job.future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))

        async def events() -> AsyncIterator[str]:
            try:
                while (text := await queue.get()) is not None:
                    yield f"data: {json.dumps({'type': 'transcript.text.delta', 'delta': text})}\n\n"
                exc = job.future.exception()
                if exc is not None:
                    body = {"type": "error", "error": {"message": str(exc)}}
                    yield f"data: {json.dumps(body)}\n\n"
                else:
                    done = {"type": "transcript.text.done", "text": job.future.result().text}
                    yield f"data: {json.dumps(done)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()  # no-op once finished; stops decoding when the client left

        self.state.live += 1  # the stream holds its slot until it ends
        return StreamingResponse(_released(events(), self.state), media_type="text/event-stream")


async def _released(events: AsyncIterator[str], state: SpeechState) -> AsyncIterator[str]:
    try:
        async for e in events:
            yield e
    finally:
        state.live -= 1


def _render(result: Any, fmt: str, task: str) -> Response:
    from tokenmill.speech.formats import to_srt, to_verbose_json, to_vtt

    if fmt == "text":
        return PlainTextResponse(result.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(to_srt(result))
    if fmt == "vtt":
        return PlainTextResponse(to_vtt(result), media_type="text/vtt")
    if fmt == "verbose_json":
        return JSONResponse(to_verbose_json(result, task))
    return JSONResponse(
        {"text": result.text, "usage": {"type": "duration", "seconds": round(result.duration, 3)}}
    )


def _wav_header(rate: int) -> bytes:
    """A streaming WAV header: mono int16, sizes unknown (0xFFFFFFFF, as streaming servers send)."""
    import struct

    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16
    ) + b"data" + struct.pack("<I", 0xFFFFFFFF)  # fmt: skip


def _encode(pcm: bytes, rate: int, fmt: str) -> bytes:
    """Whole int16 PCM -> a flac, mp3 or opus (ogg) file."""
    import io

    import numpy as np
    import soundfile as sf

    samples = np.frombuffer(pcm, dtype="<i2")
    if fmt == "opus":  # Opus takes 8/12/16/24/48 kHz only
        from tokenmill.speech.audio import resample

        samples, rate = resample(samples.astype(np.float32) / 32768, rate, 24000), 24000
    buf = io.BytesIO()
    kind = {"flac": ("FLAC", None), "mp3": ("MP3", None), "opus": ("OGG", "OPUS")}[fmt]
    sf.write(buf, samples, rate, format=kind[0], subtype=kind[1])
    return buf.getvalue()


def _metered(chunks: Any, meter: SpeechMeter, rate: int) -> Any:
    """The PCM chunks, counting their seconds as they are made."""
    for chunk in chunks:
        meter.audio("out").inc(len(chunk) / 2 / rate)
        yield chunk


class SpeechHandler:
    def __init__(self, state: SpeechState) -> None:
        self.state = state

    def require(self) -> Any:
        if self.state.tts is None:
            raise APIError(404, f"{self.state.model_name!r} is a transcription model: it does not speak",
                           type="not_found_error", code="model_not_found")  # fmt: skip
        return self.state.tts

    async def create(self, body: SpeechRequest, raw: Request) -> Response:
        from tokenmill.speech.tts import AudioParams

        st, tts = self.state, self.require()
        st.check_model(body.model, TTS_ALIASES)
        if body.response_format not in SPEECH_FORMATS:
            raise bad_request(f"response_format must be one of {sorted(SPEECH_FORMATS)}, got "
                              f"{body.response_format!r}", param="response_format")  # fmt: skip
        if body.stream_format not in ("audio", "sse"):
            raise bad_request(f"stream_format must be audio or sse, got {body.stream_format!r}",
                              param="stream_format")  # fmt: skip
        if not body.input.strip():
            raise bad_request("input is empty: send the text to speak", param="input")
        if len(body.input) > st.limits.max_input_chars:
            raise bad_request(f"input is {len(body.input)} characters; the limit is "
                              f"{st.limits.max_input_chars}", param="input")  # fmt: skip
        if body.voice not in (*tts.list_voices(), "default"):
            raise bad_request(f"unknown voice {body.voice!r}; known voices: {tts.list_voices()} "
                              "(or 'default')", param="voice", code="unknown_voice")  # fmt: skip
        params = AudioParams(voice=body.voice, speed=body.speed)
        started = time.perf_counter()
        with st.admitted():
            chunks = _metered(
                tts.generate_speech_stream(body.input, params), st.meter, tts.sample_rate
            )
            first = await asyncio.to_thread(next, chunks)  # errors here are still a 400
        st.meter.requests("speech").inc()
        st.meter.latency("speech").observe(time.perf_counter() - started)
        fmt, rate = body.response_format, tts.sample_rate
        if body.stream_format == "sse":
            return StreamingResponse(self._sse(first, chunks, raw), media_type="text/event-stream")
        if fmt in ("pcm", "wav"):
            head = _wav_header(rate) if fmt == "wav" else b""
            return StreamingResponse(
                self._audio(head, first, chunks, raw), media_type=SPEECH_FORMATS[fmt]
            )
        rest = await asyncio.to_thread(lambda: b"".join(chunks))
        data = await asyncio.to_thread(_encode, first + rest, rate, fmt)
        return Response(data, media_type=SPEECH_FORMATS[fmt])

    async def _audio(
        self, head: bytes, first: bytes, chunks: Any, raw: Request
    ) -> AsyncIterator[bytes]:
        yield head + first
        async for chunk in self._rest(chunks, raw):
            yield chunk

    async def _rest(self, chunks: Any, raw: Request) -> AsyncIterator[bytes]:
        """The chunks after the first, synthesized off the loop; stops when the client leaves."""
        self.state.live += 1
        try:
            while not await raw.is_disconnected():
                chunk = await asyncio.to_thread(next, chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            self.state.live -= 1

    async def _sse(self, first: bytes, chunks: Any, raw: Request) -> AsyncIterator[str]:
        import base64

        def event(kind: str, **fields: Any) -> str:
            return f"data: {json.dumps({'type': kind, **fields})}\n\n"

        yield event("speech.audio.delta", audio=base64.b64encode(first).decode())
        async for chunk in self._rest(chunks, raw):
            yield event("speech.audio.delta", audio=base64.b64encode(chunk).decode())
        yield event(
            "speech.audio.done", usage={"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        )


def add_speech_routes(app: FastAPI, state: SpeechState) -> None:
    """The audio routes, models and health over ``state``."""
    asr = TranscriptionHandler(state)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(raw: Request) -> Response:
        return await asr.create(raw, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(raw: Request) -> Response:
        """Into English; an English-only model just transcribes (its audio must be English)."""
        return await asr.create(raw, "translate")

    tts = SpeechHandler(state)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, raw: Request) -> Response:
        return await tts.create(body, raw)

    @app.get("/v1/audio/voices")
    async def voices() -> dict[str, Any]:
        names = tts.require().list_voices()
        return {
            "object": "list",
            "voices": [{"id": n, "name": n} for n in names],
            "default": names[0],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "tokenmill",
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.meter.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def build_speech_app(state: SpeechState, config: ServerConfig) -> FastAPI:
    from tokenmill.entrypoints.openai.server import APIKeyMiddleware

    app = FastAPI(title="tokenmill speech", version=__version__)
    install_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    add_speech_routes(app, state)
    return app


def load_speech_state(path: str | Path, model_name: str) -> SpeechState:
    """A Whisper folder -> Transcriber; a Piper voice (folder or .onnx) -> TTS."""
    from tokenmill.speech import is_speech_model

    kind = is_speech_model(path)
    if kind == "whisper":
        from tokenmill.speech import Transcriber

        return SpeechState(model_name, transcriber=Transcriber(path))
    if kind == "tts":
        from tokenmill.speech import TTS

        return SpeechState(model_name, tts=TTS(str(path)))
    raise ValueError(f"{path} is neither a Whisper folder nor a Piper voice")


class SpeechServer:
    """The speech app on uvicorn: ``run()`` in the foreground, ``start()`` in a thread."""

    def __init__(self, state: SpeechState, config: ServerConfig | None = None) -> None:
        self.state = state
        self.config = config or ServerConfig()
        self.app = build_speech_app(state, self.config)
        uv = uvicorn.Config(self.app, host=self.config.host, port=self.config.port,
                            log_level=self.config.uvicorn_log_level or self.config.log_level)  # fmt: skip
        self._uv = uvicorn.Server(uv)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        sock = self._uv.servers[0].sockets[0] if self._uv.servers else None
        port = sock.getsockname()[1] if sock is not None else self.config.port
        return f"http://127.0.0.1:{port}"

    def run(self) -> int:
        try:
            self._uv.run()
        finally:
            self._close_models()
        return 0

    def start(self, timeout: float = 30.0) -> SpeechServer:
        self._thread = threading.Thread(
            target=self._uv.run, name="tokenmill-speech-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the speech server did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self._uv.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._close_models()

    def _close_models(self) -> None:
        for runtime in (self.state.transcriber, self.state.tts):
            if runtime is not None:
                runtime.close()


def serve_speech(path: str, config: ServerConfig, model_name: str) -> int:
    """``tokenmill serve <whisper folder | piper voice>``."""
    state = load_speech_state(path, model_name)
    logging.getLogger("uvicorn.error").info(
        "tokenmill is serving %r (speech): OpenAI audio API at http://%s:%d/v1", model_name,
        config.host, config.port,
    )  # fmt: skip
    return SpeechServer(state, config).run()
