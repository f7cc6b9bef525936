"""Audio in: decode a file's bytes (libsndfile through ``soundfile``) and resample to 16 kHz."""

from __future__ import annotations

import functools
import io
import math

import numpy as np
import torch

from tokenmill.speech.mel import SAMPLE_RATE


class AudioError(ValueError):
    """The bytes are not audio this server can decode (a 400 at the HTTP boundary)."""


def decode_audio(data: bytes) -> tuple[np.ndarray, int]:
    """File bytes (wav, flac, ogg/vorbis/opus, mp3 where libsndfile has it) -> (mono float32, rate)."""
    import soundfile as sf

    if not data:
        raise AudioError("the audio file is empty")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioError(
            f"could not decode the audio file ({e}); send wav, flac, ogg or mp3"
        ) from e
    if samples.shape[0] == 0:
        raise AudioError("the audio file holds no samples")
    return samples.mean(axis=1), int(rate)


@functools.lru_cache(maxsize=16)
def _sinc_kernel(orig: int, new: int, zeros: int = 16, rolloff: float = 0.945) -> torch.Tensor:
    """[new, 1, width] Kaiser-windowed sinc phases of a polyphase ``orig -> new`` resampler."""
    cutoff = min(orig, new) * rolloff
    width = math.ceil(zeros * orig / cutoff)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None] / orig  # [1, K]
    t = idx + torch.arange(0, -new, -1, dtype=torch.float64)[:, None] / new  # [new, K]
    t = (t * cutoff).clamp(-zeros, zeros)
    window = torch.special.i0(14.77 * torch.sqrt(1 - (t / zeros) ** 2)) / torch.special.i0(
        torch.tensor(14.77)
    )
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t) * window * cutoff / orig
    return kernel.to(torch.float32)[:, None]


def resample(audio: np.ndarray, orig: int, new: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited resampling (the windowed-sinc method of torchaudio's ``resample``)."""
    if orig == new:
        return audio.astype(np.float32, copy=False)
    g = math.gcd(orig, new)
    o, n = orig // g, new // g
    kernel = _sinc_kernel(o, n)
    width = (kernel.shape[-1] - o) // 2
    x = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None, None]
    x = torch.nn.functional.pad(x, (width, width + o))
    y = torch.nn.functional.conv1d(x, kernel, stride=o)  # [1, n, frames]
    out = y[0].t().reshape(-1)[: math.ceil(n * len(audio) / o)]
    return out.numpy()


def load_audio(
    data: bytes | np.ndarray | tuple[np.ndarray, int], rate: int | None = None
) -> np.ndarray:
    """Bytes of a file, (samples, rate), or samples at ``rate`` (default 16 kHz) -> 16 kHz mono."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        samples, rate = decode_audio(bytes(data))
    elif isinstance(data, tuple):
        samples, rate = np.asarray(data[0], dtype=np.float32), int(data[1])
    else:
        samples = np.asarray(data, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1 if samples.shape[1] <= 8 else 0)
    return resample(samples, rate or SAMPLE_RATE)
