"""Piper VITS in our PyTorch code vs onnxruntime on the ONNX file, and TTS -> Whisper round trips."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tokenmill.speech.espeak import phonemize
from tokenmill.speech.tts import AudioParams, split_sentences
from tokenmill.speech.vits import Scales

HIDDEN = [
    "The little boat sailed across the quiet lake at sunrise.",
    "Please bring your umbrella because it may rain this afternoon.",
    "Fresh bread and warm soup make a wonderful dinner in winter.",
    "The students listened carefully while the teacher explained the lesson.",
]


def wer(ref: str, hyp: str) -> tuple[int, int]:
    """(word edits, reference words) after lower-casing and dropping punctuation."""
    r, h = (re.sub(r"[^a-z' ]", " ", s.lower()).split() for s in (ref, hyp))
    d = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, d[0] = d[0], i
        for j, hw in enumerate(h, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
    return d[len(h)], len(r)


def test_matches_onnxruntime_without_noise(tts, piper_voice):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(
        str(next(piper_voice.glob("*.onnx"))), providers=["CPUExecutionProvider"]
    )
    for text in HIDDEN[:2]:
        ids = tts.voice.ids(phonemize(text))
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),  # noise off: deterministic
        }
        ref = sess.run(None, feed)[0].ravel()
        with torch.inference_mode():
            ours = tts.voice.model(torch.tensor([ids]), Scales(0.0, 1.0, 0.0)).numpy()
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=2e-3)
        assert np.abs(ours - ref).mean() < 1e-4


def test_round_trip_through_whisper(tts, transcriber, long_sentences):
    """16 sentences (the word error rate of 4 swings by +-5 points with the noise seed)."""
    texts = HIDDEN + long_sentences
    audios = [(tts.generate_speech(t).astype(np.float32) / 32768, tts.sample_rate) for t in texts]
    heard = transcriber.transcribe_batch(audios)
    edits, words = map(sum, zip(*(wer(t, h.text) for t, h in zip(texts, heard))))
    assert edits / words <= 0.10, (edits, words, [h.text for h in heard])


def test_phoneme_ids_as_piper_makes_them(tts):
    m = tts.voice.phoneme_ids
    ids = tts.voice.ids("hə\u0000")  # an unknown symbol is dropped
    assert ids == m["^"] + m["_"] + m["h"] + m["_"] + m["ə"] + m["_"] + m["$"]


def test_stream_pieces_join_into_the_whole(tts):
    text = "Hello there. How are you today? Fine, thanks."
    chunks = list(tts.generate_speech_stream(text))
    assert len(chunks) > 3 and all(len(c) % 2 == 0 for c in chunks)  # sentences, in pieces
    streamed = np.frombuffer(b"".join(chunks), dtype="<i2").astype(np.int32)
    whole = np.concatenate(
        [(tts.synthesize(s).numpy() * 32767).round() for s in split_sentences(text)]
    )
    assert len(streamed) == len(whole) and np.abs(streamed - whole).max() <= 1
    assert split_sentences("One.  Two!\nThree") == ["One.", "Two!", "Three"]


def test_vocoder_pieces_equal_the_one_piece_output(tts):
    """Latent frames decoded in overlapping pieces (the streaming path) give dec(z)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(1, tts.voice.model.cfg.inter, 700, generator=g)
    model = tts.voice.model
    with torch.inference_mode():
        whole = model.dec(z)[0, 0]
        for first, size in ((24, 512), (24, 256), (50, 100)):
            pieces = list(model.decode_chunks(z, first=first, size=size))
            assert len(pieces) == 1 + -(-(700 - first) // size)
            assert len(pieces[0]) == first * model.hop
            joined = torch.cat(pieces)
            assert joined.shape == whole.shape
            assert (joined - whole).abs().max() < 1e-4


def test_voices_speed_and_errors(tts):
    assert tts.list_voices() == ["en_US-joe-medium"]
    normal = len(
        tts.generate_speech("Good morning everyone.", AudioParams(voice="en_US-joe-medium"))
    )
    fast = len(tts.generate_speech("Good morning everyone.", AudioParams(speed=2.0)))
    assert 0.35 < fast / normal < 0.65
    with pytest.raises(ValueError, match="known voices"):
        list(tts.generate_speech_stream("Hi.", AudioParams(voice="alloy")))
    with pytest.raises(ValueError, match="empty"):
        list(tts.generate_speech_stream("   "))
    with pytest.raises(ValueError, match="speed"):
        AudioParams(speed=9)


def test_flows_on_the_first_frames_equal_the_whole(tts):
    """The stream's first piece maps only its frames (and FLOW_CONTEXT more) through the flows."""
    g = torch.Generator().manual_seed(3)
    zp = torch.randn(1, tts.voice.model.cfg.inter, 300, generator=g)
    model = tts.voice.model
    with torch.inference_mode():
        whole = model.flows(zp)
        for frames in (36, 100, 290):
            head = model.flows(zp, frames)
            assert head.shape[2] == frames
            assert (head - whole[:, :, :frames]).abs().max() < 1e-4
        cut = model.flows(zp[:, :, :36])  # no context: the last frames differ
        assert (cut[:, :, 30:] - whole[:, :, 30:36]).abs().max() > 1e-3


def test_piece_plan_ramps_up():
    """growth 2: 24, 48, 96 ... while under the cap and the rest holds two of the next."""
    from tokenmill.speech.vits import pieces

    def spans(plan):
        return [(p.start, p.end) for p in plan]

    assert spans(pieces(324, 24, 512, 1, 2)) == [(0, 24), (24, 72), (72, 168), (168, 324)]
    assert spans(pieces(700, 24, 512, 2, 2)) == [
        (0, 24), (24, 72), (72, 168), (168, 360), (360, 530), (530, 700)
    ]  # fmt: skip
    assert spans(pieces(2000, 24, 512, 1, 2))[4] == (360, 744)  # 384 < 512; 768 is not
    assert spans(pieces(100, 24, 512, 1, 2)) == [(0, 24), (24, 100)]  # 24 + 2 x 48 > 100
    assert spans(pieces(700, 24, 512, 1, 1)) == spans(pieces(700, 24, 512))


def test_first_sentence_streams_in_growing_pieces(tts, long_sentences):
    """Each piece of the first sentence is twice the one before (decoded while it plays),
    and the pieces still join into the one-piece synthesis."""
    text = long_sentences[0] + " " + long_sentences[1]
    chunks = list(tts.generate_speech_stream(text))
    hop = tts.voice.model.hop
    assert [len(c) // 2 for c in chunks[:3]] == [24 * hop, 48 * hop, 96 * hop]
    streamed = np.frombuffer(b"".join(chunks), dtype="<i2").astype(np.int32)
    whole = np.concatenate(
        [(tts.synthesize(s).numpy() * 32767).round() for s in split_sentences(text)]
    )
    assert len(streamed) == len(whole) and np.abs(streamed - whole).max() <= 1


def test_next_sentences_wait_for_the_first_prior(piper_voice, monkeypatch):
    """The second worker does not compute sentence 1's prior while sentence 0's runs (on
    shared cores that doubled the time to the first chunk)."""
    import threading
    import time

    from tokenmill.speech.tts import TTS

    two = TTS(piper_voice, warmup=False, workers=2)
    events, lock = [], threading.Lock()
    prior = two._prior

    def traced(sentence, params):
        with lock:
            events.append(("start", sentence))
        time.sleep(0.05 if sentence == "One." else 0)
        out = prior(sentence, params)
        with lock:
            events.append(("end", sentence))
        return out

    monkeypatch.setattr(two, "_prior", traced)
    try:
        b"".join(two.generate_speech_stream("One. Two. Three. Four. Five."))
    finally:
        two.close()
    assert events[:2] == [("start", "One."), ("end", "One.")]
    assert sorted(s for kind, s in events if kind == "start") == sorted(
        ["One.", "Two.", "Three.", "Four.", "Five."]
    )
