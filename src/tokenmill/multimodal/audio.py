"""The boundary for Qwen2-Audio: (samples, rate) -> 30 s windows of log-mel features.

transformers' Whisper feature extractor (numpy; settings from the checkpoint's
``preprocessor_config.json``: 128 bins, 16 kHz, 30 s windows) makes each window's
[128, 3000] features and valid frame count, exactly as Qwen2-Audio's processor calls it
(``padding="max_length"``, attention mask). Audio longer than one window is cut into
consecutive windows, never truncated (transformers' processor keeps only the first 30 s):
each window is one media item, and the audio's ``<|AUDIO|>`` becomes one run per window,
back to back. Audio at another rate is resampled (scipy's polyphase filter).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from math import gcd
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.multimodal.hashing import content_hash
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs, PlaceholderRange
from tokenmill.multimodal.model import MultiModalInfo
from tokenmill.multimodal.options import MediaOptions, check_counts
from tokenmill.multimodal.processing import check_modalities, placeholder_marks


def audio_tokens(frames: int) -> int:
    """Encoder output tokens of ``frames`` valid mel frames (HF's length rule)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def load_feature_extractor(folder: Path | None) -> Any:
    from transformers import WhisperFeatureExtractor

    config: dict[str, Any] = {"feature_size": 128}
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    if path is not None and path.is_file():
        config.update(json.loads(path.read_text()))
    keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
    return WhisperFeatureExtractor(**{k: config[k] for k in keys if k in config})


class Qwen2AudioProcessor:
    def __init__(self, info: MultiModalInfo, extractor: Any, limits: Mapping[str, int]) -> None:
        self.info = info
        self.extractor = extractor
        self.defaults = MediaOptions()
        self.limits = dict(limits)
        self.preprocess_seconds = 0.0
        self.items_processed = 0

    def process(
        self, prompt_ids: list[int], data: Mapping[str, Any], options: MediaOptions
    ) -> tuple[list[int], MultiModalInputs]:
        t0 = time.perf_counter()
        check_modalities(data, ("audio",))
        if options != MediaOptions():
            raise InvalidRequestError(
                "mm_processor_kwargs: Qwen2-Audio takes none (its features follow the "
                "checkpoint's preprocessor_config.json, and audio past its 30 s window is "
                "chunked): remove them"
            )
        raw = data.get("audio")
        audios = [] if raw is None else list(raw) if isinstance(raw, list) else [raw]
        check_counts({"audio": len(audios)}, self.limits)
        token = self.info.audio_token_id
        marks = placeholder_marks(prompt_ids, token, len(audios),
                                  "<|AUDIO|> audio item", "<|audio_bos|><|AUDIO|><|audio_eos|>")  # fmt: skip
        windows = [self._windows(a) for a in audios]
        ids: list[int] = []
        items: list[MediaItem] = []
        ranges: list[PlaceholderRange] = []
        prev = 0
        for pos, wins in zip(marks, windows):
            ids += prompt_ids[prev:pos]
            for item in wins:
                ranges.append(PlaceholderRange(len(ids), item.num_tokens))
                ids += [token] * item.num_tokens
                items.append(item)
            prev = pos + 1
        ids += prompt_ids[prev:]
        seconds = time.perf_counter() - t0
        self.preprocess_seconds += seconds
        self.items_processed += len(audios)
        return ids, MultiModalInputs(tuple(items), tuple(ranges), None, 0, seconds)

    def _windows(self, audio: Any) -> list[MediaItem]:
        samples = self._samples(audio)
        fe = self.extractor
        size = fe.n_samples  # samples per window (30 s)
        out = []
        for start in range(0, max(len(samples), 1), size):
            chunk = samples[start : start + size]
            feats = fe(chunk, sampling_rate=fe.sampling_rate, return_attention_mask=True,
                       padding="max_length", return_tensors="np")  # fmt: skip
            mel = torch.from_numpy(
                np.ascontiguousarray(feats["input_features"][0], dtype=np.float32)
            )
            frames = int(feats["attention_mask"][0].sum())
            grid = (1, mel.shape[0], frames)  # (the valid frame count rides in the grid)
            out.append(
                MediaItem(
                    "audio", content_hash("audio", mel, grid), mel, grid, audio_tokens(frames)
                )
            )
        return out

    def _samples(self, audio: Any) -> np.ndarray:
        """(samples, rate) or samples at the extractor's rate -> float32 mono at its rate."""
        rate = self.extractor.sampling_rate
        if isinstance(audio, tuple) and len(audio) == 2:
            audio, src = audio
        else:
            src = rate
        x = np.asarray(audio, dtype=np.float32)
        if x.ndim == 2:  # [samples, channels] or [channels, samples] -> mono
            x = x.mean(axis=int(np.argmin(x.shape)))
        if x.ndim != 1 or x.size == 0:
            raise InvalidRequestError(
                "audio must be a non-empty 1-D array of samples (or 2-D with channels)"
            )
        if int(src) != rate:
            from scipy.signal import resample_poly

            g = gcd(int(src), rate)
            x = resample_poly(x, rate // g, int(src) // g).astype(np.float32)
        return x
