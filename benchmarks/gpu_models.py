"""Random-weight models of real shapes for gpu_suite.py: no download, weights made on the device.

A model folder holds the shape's real ``config.json`` and a word-level tokenizer ("t0",
"t1", ... one token per id) so the engine has a tokenizer; prompts are token ids.
With transformers the weights come from its own random init (on the device, in bf16) and
tokenmill loads them from that model's state dict (or from safetensors written to the
folder, to time the disk load), so both engines run the same weights.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIGS = Path(__file__).parent / "configs"
SHAPES = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b", "tiny": "tiny-llama"}


def shape_config(shape: str) -> dict:
    return json.loads((CONFIGS / f"{SHAPES[shape]}.json").read_text())


def write_folder(folder: Path, hf_config: dict) -> Path:
    """config.json + a word-level tokenizer of the config's vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    vocab = {f"t{i}": i for i in range(hf_config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="t0",
        bos_token=f"t{hf_config['bos_token_id']}",
        eos_token=f"t{hf_config['eos_token_id']}",
    )
    fast.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_hf(hf_config: dict, device: torch.device, dtype: torch.dtype):
    """transformers' LlamaForCausalLM with its own random init, built on ``device`` in
    ``dtype`` (sdpa attention)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**hf_config)
    with torch.device(device), default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    p = next(model.parameters())
    if p.device.type != device.type or p.dtype != dtype:  # an old transformers ignored a context
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def random_fill_(model: torch.nn.Module, seed: int = 0) -> None:
    """Without transformers: normal(0, 0.02) weights, unit norms (made on the device)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, 0.02, generator=g)


@dataclass
class Built:
    loaded: object
    """tokenmill's LoadedModel (None when loading from the folder through the engine)."""
    hf: object | None
    load_seconds: float | None = None


def build_tokenmill(folder: Path, hf_config: dict, device: torch.device, dtype: torch.dtype,
                    max_model_len: int, hf_model=None):  # fmt: skip
    """LoadedModel built on the device; weights from ``hf_model``'s state dict, else random."""
    from tokenmill.engine.loading import LoadedModel
    from tokenmill.loader import Checkpoint
    from tokenmill.loader.hf_config import normalize_hf_config
    from tokenmill.models import resolve_model_class
    from tokenmill.tokenizer import load_tokenizer

    ckpt = Checkpoint(path=str(folder), format="hf", hf_config=normalize_hf_config(hf_config))
    cls = resolve_model_class(ckpt.hf_config.get("architectures"))
    with torch.device(device):
        model = cls(ckpt.hf_config, dtype, max_positions=max_model_len)
    if hf_model is not None:
        with torch.no_grad():
            model.load_weights(iter(hf_model.state_dict().items()))
    else:
        random_fill_(model)
    model.eval()
    return LoadedModel(ckpt, model, load_tokenizer(ckpt), max_model_len, dtype, device)


def save_safetensors(hf_model, folder: Path) -> float:
    """Write the HF model's weights into the folder (safetensors); returns seconds."""
    start = time.perf_counter()
    hf_model.save_pretrained(folder, safe_serialization=True)
    return time.perf_counter() - start


def free() -> None:
    """Collect what the caller dropped and hand the cached device memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
