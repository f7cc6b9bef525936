"""The Whisper engine thread computes: the threads that load the model and start
transcriptions let go of their OpenMP workers (``tokenmill.threads``)."""

from __future__ import annotations

from openmp_probe import on_linux, run_probe


@on_linux
def test_a_transcriber_leaves_its_callers_thread_without_workers(whisper_ct2):
    """The Whisper engine thread computes: the thread that loaded the model and the one that
    started a transcription keep no OpenMP workers (each would stop the engine's workers
    spin-waiting at every op's barrier). Measured as: the caller's next parallel op starts
    a worker, which it would not if the caller still had one."""
    out = run_probe(f"""
import numpy as np
from tokenmill.speech import Transcriber

t = Transcriber({str(whisper_ct2)!r})
before = settle(tasks())
x @ x
after_load = settle(before + 1) - before
release_openmp_threads()
settle(before)
t.transcribe(np.zeros(16000 * 2, np.float32))  # loads audio, computes features here
before = settle(tasks())
x @ x
after_start = settle(before + 1) - before
t.close()
print(after_load, after_start)
""")
    assert out.split() == ["1", "1"]


@on_linux
def test_a_voice_leaves_its_loading_thread_without_workers(piper_voice):
    """A TTS voice loads (and warms up) on the caller's thread and computes on its workers:
    the caller keeps no OpenMP workers (a speech server loads Whisper and a voice side by
    side: they would throttle Whisper's engine thread)."""
    out = run_probe(f"""
from tokenmill.speech import TTS

tts = TTS({str(piper_voice)!r})
before = settle(tasks())
x @ x
print(settle(before + 1) - before)
tts.close()
""")
    assert out.split() == ["1"]
