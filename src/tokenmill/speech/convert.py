"""CTranslate2 Whisper folder -> HF folder (safetensors + config), e.g. to run transformers on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tokenmill.speech.config import WhisperConfig
from tokenmill.speech.ct2 import hf_weights, read_ct2
from tokenmill.speech.tokens import WhisperTokens


def ct2_to_hf(folder: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model.safetensors``, ``config.json``, ``generation_config.json`` and the tokenizer."""
    from safetensors.torch import save_file

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, _ = read_ct2(folder / "model.bin")
    cfg = WhisperConfig.from_ct2(tensors)
    del tensors
    state = {
        f"model.{name}": t.to(dtype).contiguous() for name, t in hf_weights(folder / "model.bin")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    ct2_cfg = json.loads((folder / "config.json").read_text())
    tokens = WhisperTokens.load(folder, cfg.multilingual)
    ids = {"decoder_start_token_id": tokens.sot, "bos_token_id": tokens.eot,
           "eos_token_id": tokens.eot, "pad_token_id": tokens.eot}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg.to_hf() | ids, indent=2))
    gen = {
        **ids,
        "suppress_tokens": ct2_cfg.get("suppress_ids", []),
        "begin_suppress_tokens": ct2_cfg.get("suppress_ids_begin", []),
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shutil.copy(folder / "tokenizer.json", out / "tokenizer.json")
    return out
