"""/v1/audio/speech and /v1/audio/voices through the OpenAI client, and bad input."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from tokenmill.entrypoints.openai.serving_speech import SpeechServer, SpeechState
from tokenmill.entrypoints.openai.state import ServerConfig


@pytest.fixture(scope="module")
def server(tts):
    srv = SpeechServer(
        SpeechState("joe", tts=tts), ServerConfig(port=0, log_level="warning")
    ).start()
    yield srv
    srv._uv.should_exit = True  # the session's TTS outlives this server
    srv._thread.join(10)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_speech_files(client, fmt):
    out = client.audio.speech.create(
        model="tts-1", voice="default", input="Good morning.", response_format=fmt
    )
    audio, rate = sf.read(io.BytesIO(out.content))
    assert rate == (24000 if fmt == "opus" else 22050)
    assert 0.4 < len(audio) / rate < 3 and np.abs(audio).max() > 0.05


def test_pcm_streams_in_chunks(client, tts):
    text = "First sentence here. And a second one."
    with client.audio.speech.with_streaming_response.create(
        model="joe", voice="en_US-joe-medium", input=text, response_format="pcm"
    ) as r:
        body = b"".join(r.iter_bytes())
    assert body == b"".join(tts.generate_speech_stream(text))  # seeded: the same samples


def test_sse(server):
    r = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
        "model": "tts-1", "input": "One. Two.", "stream_format": "sse", "response_format": "pcm"})  # fmt: skip
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert (
        len(kinds) >= 3
        and set(kinds[:-1]) == {"speech.audio.delta"}
        and kinds[-1] == "speech.audio.done"
    )
    assert len(base64.b64decode(events[0]["audio"])) > 1000


def test_voices(server):
    body = httpx.get(server.url + "/v1/audio/voices").json()
    assert [v["id"] for v in body["voices"]] == ["en_US-joe-medium"]


BAD = [
    ({"voice": "alloy"}, 400, "known voices: ['en_US-joe-medium']"),
    ({"input": "  "}, 400, "empty"),
    ({"response_format": "aac"}, 400, "response_format"),
    ({"speed": 5}, 400, "speed"),
    ({"stream_format": "ws"}, 400, "stream_format"),
    ({"input": "x" * 5000}, 400, "limit"),
    ({"model": "gpt-9"}, 404, "does not exist"),
]


@pytest.mark.parametrize("change,status,needle", BAD)
def test_bad_input(server, change, status, needle):
    body = {
        "model": "tts-1",
        "input": "Hello.",
        "voice": "default",
        "response_format": "wav",
    } | change
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": ("a", b"x")},
    )
    assert r.status_code == 404  # this server speaks; it does not transcribe
    ok = httpx.post(
        server.url + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi."}, timeout=60
    )
    assert ok.status_code == 200


def test_metrics(server):
    httpx.post(server.url + "/v1/audio/speech", json={"model": "tts-1", "input": "Hi."}, timeout=60)
    text = httpx.get(server.url + "/metrics").text
    assert 'tokenmill:speech_requests_total{endpoint="speech"}' in text
    out = [
        ln
        for ln in text.splitlines()
        if ln.startswith('tokenmill:speech_audio_seconds_total{direction="out"}')
    ]
    assert out and float(out[0].split()[-1]) > 0.3
    assert "tokenmill:speech_live_requests" in text
