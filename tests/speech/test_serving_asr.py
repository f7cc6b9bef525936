"""/v1/audio/transcriptions and /translations through the OpenAI client, and bad input."""

from __future__ import annotations

import io

import httpx
import pytest
import soundfile as sf

from tokenmill.entrypoints.openai.serving_speech import SpeechServer, SpeechState
from tokenmill.entrypoints.openai.state import ServerConfig


def _wav(clip, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, clip[0], clip[1], format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(transcriber):
    state = SpeechState("whisper-tiny.en", transcriber=transcriber)
    srv = SpeechServer(state, ServerConfig(port=0, log_level="warning")).start()
    yield srv
    srv._uv.should_exit = True  # the session's transcriber outlives this server
    srv._thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none")


def test_transcription_json_and_text(client, clips):
    out = client.audio.transcriptions.create(
        model="whisper-tiny.en", file=("a.wav", _wav(clips[3]))
    )
    assert "in the morning to discuss the new project" in out.text
    text = client.audio.transcriptions.create(
        model="whisper-1", file=("a.flac", _wav(clips[0], "FLAC")), response_format="text"
    )
    assert "lazy" in text


def test_mp3_upload(client, clips):
    """An MP3 file (libsndfile >= 1.1 decodes it; soundfile's wheels ship one) at the clip's
    rate, resampled to 16 kHz on the way in."""
    if "MP3" not in sf.available_formats():
        pytest.skip("this libsndfile has no MP3")
    text = client.audio.transcriptions.create(
        model="whisper-1", file=("a.mp3", _wav(clips[1], "MP3")), response_format="text"
    )
    assert "call stella and ask her to bring these things" in text.lower()


def test_verbose_json_srt_vtt(client, clips):
    v = client.audio.transcriptions.create(
        model="whisper-1", file=("a.ogg", _wav(clips[2], "OGG")), response_format="verbose_json",
        timestamp_granularities=["segment"],
    )  # fmt: skip
    assert v.language == "english" and v.segments and v.segments[0].start == 0.0
    assert abs(v.duration - len(clips[2][0]) / clips[2][1]) < 0.01
    srt = client.audio.transcriptions.create(
        model="whisper-1", file=("a.wav", _wav(clips[2])), response_format="srt"
    )
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0")
    vtt = client.audio.transcriptions.create(
        model="whisper-1", file=("a.wav", _wav(clips[2])), response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_translation_and_stream(client, server, clips):
    out = client.audio.translations.create(model="whisper-1", file=("a.wav", _wav(clips[2])))
    assert "beautiful day" in out.text
    with httpx.stream("POST", server.url + "/v1/audio/transcriptions", timeout=60,
                      data={"model": "whisper-1", "stream": "true"},
                      files={"file": ("a.wav", _wav(clips[2]))}) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"transcript.text.done"' in events[-2]
    assert any('"transcript.text.delta"' in e for e in events)


BAD = [
    ({"model": "whisper-1"}, None, "file"),
    ({"model": "whisper-1"}, ("a.wav", b"RIFF not really a wav file"), "could not decode"),
    ({"model": "whisper-1"}, ("a.txt", b"hello"), "could not decode"),
    ({"model": "whisper-1"}, ("a.wav", b""), "empty"),
    ({"model": "whisper-1", "response_format": "docx"}, "clip", "response_format"),
    ({"model": "whisper-1", "temperature": "hot"}, "clip", "temperature"),
    ({"model": "whisper-1", "temperature": "3"}, "clip", "temperature"),
    ({"model": "whisper-1", "language": "de"}, "clip", "English-only"),
    ({"model": "whisper-1", "timestamp_granularities[]": "word"}, "clip", "word"),
    ({}, "clip", "model is required"),
]


@pytest.mark.parametrize("data,file,needle", BAD)
def test_bad_input_is_a_400(server, clips, data, file, needle):
    files = (
        {"file": ("a.wav", _wav(clips[0]))} if file == "clip" else {"file": file} if file else None
    )
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        data=data,
        files=files or {"x": ("x", b"")},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                    files={"file": ("a.wav", _wav(clips[0]))}, timeout=60)  # fmt: skip
    assert ok.status_code == 200  # still serving


def test_limits(server, clips):
    limits = server.state.limits
    object.__setattr__(limits, "max_file_bytes", 1000)
    try:
        r = httpx.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                       files={"file": ("a.wav", _wav(clips[0]))})  # fmt: skip
        assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]
    finally:
        object.__setattr__(limits, "max_file_bytes", 25 * 1024 * 1024)
    object.__setattr__(limits, "max_audio_seconds", 1.0)
    try:
        r = httpx.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                       files={"file": ("a.wav", _wav(clips[0]))})  # fmt: skip
        assert r.status_code == 400 and "limit is 1 s" in r.json()["error"]["message"]
    finally:
        object.__setattr__(limits, "max_audio_seconds", 3600.0)
    r = httpx.post(server.url + "/v1/audio/transcriptions", json={"model": "whisper-1"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "whisper-tiny.en"


def test_concurrent_requests_batch(server, transcriber, clips):
    import concurrent.futures as cf

    wav = _wav(clips[1])

    def one(_: int) -> str:
        r = httpx.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1"},
                       files={"file": ("a.wav", wav)}, timeout=120)  # fmt: skip
        return r.json()["text"]

    with cf.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(one, range(4)))
    assert texts == [transcriber.transcribe(wav).text] * 4
