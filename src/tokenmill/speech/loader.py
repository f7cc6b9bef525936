"""Whisper folders: the CTranslate2 layout as faster-whisper ships it, or an HF folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.speech.config import WhisperConfig
from tokenmill.speech.ct2 import hf_weights, read_ct2
from tokenmill.speech.tokens import WhisperTokens
from tokenmill.speech.whisper import Whisper, pack_native


def is_whisper_folder(path: str | Path) -> bool:
    """A folder holding a Whisper checkpoint: CTranslate2 (``model.bin``) or HF (config.json)."""
    p = Path(path)
    if not p.is_dir() or not (p / "tokenizer.json").is_file():
        return False
    if (p / "model.bin").is_file():
        with open(p / "model.bin", "rb") as f:
            head = f.read(64)
        return b"Whisper" in head
    cfg = p / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "whisper"
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class LoadedWhisper:
    model: Whisper
    tokens: WhisperTokens
    suppress: tuple[int, ...]
    """Tokens never generated (the checkpoint's list plus the task/control tokens)."""
    suppress_begin: tuple[int, ...]
    """Tokens not allowed as the first generated token (blank, eot)."""


def _hf_stream(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has neither model.bin (CTranslate2) nor *.safetensors (HF)")
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name == "proj_out.weight":
                    continue  # tied to the token embedding
                yield name.removeprefix("model."), f.get_tensor(name)


def load_whisper(folder: str | Path, dtype: torch.dtype = torch.float32) -> LoadedWhisper:
    """Build on the meta device, then take each streamed tensor once (cast to ``dtype``)."""
    folder = Path(folder)
    if not is_whisper_folder(folder):
        raise ValueError(
            f"{folder} is not a Whisper folder (model.bin or config.json with tokenizer.json)"
        )
    extra = (
        json.loads((folder / "config.json").read_text())
        if (folder / "config.json").is_file()
        else {}
    )
    if (folder / "model.bin").is_file():
        tensors, _ = read_ct2(folder / "model.bin")
        cfg = WhisperConfig.from_ct2(tensors)
        del tensors
        stream = hf_weights(folder / "model.bin")
        suppress = extra.get("suppress_ids", [])
        begin = extra.get("suppress_ids_begin", [])
    else:
        cfg = WhisperConfig.from_hf(extra)
        stream = _hf_stream(folder)
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        suppress = gen.get("suppress_tokens", [])
        begin = gen.get("begin_suppress_tokens", [])
    with torch.device("meta"):
        model = Whisper(cfg)
    state = {name: t.to(dtype) for name, t in stream}
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{folder}: weights missing for {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)
    pack_native(model)
    tokens = WhisperTokens.load(folder, cfg.multilingual)
    suppress_all = tuple(sorted(set(suppress) | set(tokens.extra_suppress)))
    return LoadedWhisper(model, tokens, suppress_all, tuple(begin))
