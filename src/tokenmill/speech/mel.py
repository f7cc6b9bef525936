"""Whisper's log-mel features (equal to transformers' ``WhisperFeatureExtractor``).

16 kHz audio, 25 ms Hann windows every 10 ms (n_fft 400, hop 160), a Slaney mel bank
of ``n_mels`` filters up to 8 kHz, log10 clamped to 8 decades below the window's peak,
then ``(x + 4) / 4``. One window is 30 s: 480000 samples -> 3000 frames.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
WINDOW_SAMPLES = 30 * SAMPLE_RATE
WINDOW_FRAMES = WINDOW_SAMPLES // HOP  # 3000
FRAMES_PER_SECOND = SAMPLE_RATE // HOP  # 100


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = 3.0 * f / 200.0
    log_region = f >= 1000.0
    return np.where(
        log_region, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * 27.0 / np.log(6.4), mel
    )


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f = 200.0 * m / 3.0
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), f)


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular Slaney-normalized filters over 0..8 kHz."""
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    mel_pts = np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2)
    filter_freqs = _mel_to_hz(mel_pts)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # [bins, n_mels + 2]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))  # [bins, n_mels]
    fb *= 2.0 / (filter_freqs[2 : n_mels + 2] - filter_freqs[:n_mels])
    return torch.from_numpy(fb.T.astype(np.float32))


def log_mel(audio: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """[B, samples] float 16 kHz (each padded/cut to 30 s here) -> [B, n_mels, 3000]."""
    audio = audio.to(torch.float32)
    if audio.shape[-1] < WINDOW_SAMPLES:
        audio = torch.nn.functional.pad(audio, (0, WINDOW_SAMPLES - audio.shape[-1]))
    audio = audio[..., :WINDOW_SAMPLES]
    window = torch.hann_window(N_FFT)
    stft = torch.stft(audio, N_FFT, HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2  # [B, bins, 3000]
    mel = mel_filters(n_mels) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0
