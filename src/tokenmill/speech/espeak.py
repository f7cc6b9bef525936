"""espeak-ng from PyPI (``espeakng-loader`` ships the library and its data): IPA phonemes
for Piper, and plain synthesized speech (the test clips for Whisper)."""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import unicodedata

import numpy as np

_SYNTH_LOCK = threading.Lock()  # espeak-ng's synthesizer is one global state


def _paths() -> tuple[str, str]:
    try:
        import espeakng_loader
    except ImportError as e:
        raise RuntimeError("espeak-ng is missing: pip install espeakng-loader") from e
    return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()


IPA = 0x02
"""espeak_TextToPhonemes' phoneme mode: IPA, no separator between phonemes."""
UTF8 = 1
"""espeak_TextToPhonemes' text mode: espeakCHARS_UTF8."""

_TERMINATORS = {".": ".", "?": "?", "!": "!", ",": ",", ":": ":", ";": ";", "\u2014": ";",
                "\u2013": ";", "\u2026": ""}  # fmt: skip
"""A clause's closing punctuation -> the mark kept after its phonemes, as piper-tts keeps
it from espeak-ng's clause type: dashes are semicolon clauses, an ellipsis none."""
_SENTENCE_END = ".?!"
_QUOTES = "\"'\u201c\u201d\u2018\u2019\u00ab\u00bb()[]{}"
"""Quotes and brackets around a clause's end: espeak-ng ends the clause but speaks none."""
_LANG_FLAG = re.compile(r"\([^)]+\)")
"""``(fr)`` ... ``(en)``: espeak-ng's marks around a word it read in another language."""


def _phoneme_lib() -> ctypes.CDLL:
    lib = _synth_lib()[0]  # one library, one global state: the synthesizer's lock guards both
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                          ctypes.c_int]  # fmt: skip
    return lib


def _clauses(text: str, voice: str) -> list[tuple[str, str]]:
    """(IPA, the text espeak-ng read for it) per clause, as espeak-ng splits the text (it
    knows abbreviations, decimals and that a full stop before lower case ends nothing)."""
    lib = _phoneme_lib()
    data = text.encode()
    buf = ctypes.create_string_buffer(data)
    start = ctypes.addressof(buf)
    ptr = ctypes.c_void_p(start)
    out = []
    with _SYNTH_LOCK:
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        while ptr.value is not None:
            begin = ptr.value - start
            ipa = lib.espeak_TextToPhonemes(ctypes.byref(ptr), UTF8, IPA)
            end = len(data) if ptr.value is None else ptr.value - start
            out.append(((ipa or b"").decode(), data[begin:end].decode(errors="ignore")))
    return out


def _terminator(read: str, last: bool) -> str:
    """The mark that closed a clause, from the text espeak-ng read for it. Before it stops,
    espeak-ng has read one character of the next clause (after the space); at the text's
    end there is none."""
    read = read.rstrip()
    if not last and len(read) > 1 and read[-2].isspace() and read[-1] not in _TERMINATORS:
        read = read[:-1]
    after_words = read[len(read.rstrip("".join(_TERMINATORS) + _QUOTES + " \t\n")) :]
    marks = "".join(c for c in after_words if c in _TERMINATORS)
    # espeak-ng reads "..." as an ellipsis, a clause piper-tts gives no mark (".." is ".")
    if not marks or marks.startswith("..."):
        return ""
    # the first mark closes the clause ("?!" is a question, "U.S. -" a full stop): espeak-ng
    # reads the marks after it into the same clause and speaks none of them
    return _TERMINATORS[marks[0]]


def phonemize_sentences(text: str, voice: str = "en-us") -> list[str]:
    """IPA per sentence with stress marks and the clause marks, the way piper-tts phonemizes
    (what its voices are fed): espeak-ng's clauses, each followed by its mark (and
    a space after , : ;), a new sentence after . ? !, decomposed (NFD) so that accents are
    symbols of their own.

    Unlike piper-tts 1.8.0 we keep espeak-ng 1.52's output: piper-tts' own espeak-ng build
    (a later commit) writes the linking phoneme between an i vowel and a vowel as ʲ
    ("the old" -> ðɪʲ ˈoʊld; espeak-ng issue #2367 calls it a regression); the voices
    predate that build (trained with piper-phonemize's espeak-ng, which has no such ʲ)."""
    sentences, current = [], ""
    clauses = _clauses(text, voice)
    for i, (ipa, read) in enumerate(clauses):
        last = i == len(clauses) - 1
        mark = _terminator(read, last)
        # as piper-tts: no space after a clause of no mark, so "Wait... what?" runs the
        # two words together (wˈeɪtwˌʌt?): odd, but those are the ids piper-tts feeds them
        current += _LANG_FLAG.sub("", ipa) + mark + (" " if mark in (",", ":", ";") else "")
        if (mark and mark in _SENTENCE_END) or last:
            sentences.append(unicodedata.normalize("NFD", current))
            current = ""
    return [s for s in sentences if s]


def phonemize(text: str, voice: str = "en-us") -> str:
    """The text's phonemes as one sentence (``phonemize_sentences``, joined by spaces)."""
    return " ".join(phonemize_sentences(text, voice))


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
