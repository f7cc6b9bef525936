"""CTranslate2 ``model.bin`` (the faster-whisper format) read as a stream of HF-named tensors.

Layout (version 6): u32 version, string spec name, u32 revision, u32 variable count, then
per variable: string name, u8 ndim, u32 dims, u8 dtype, u32 byte count, raw bytes; then
u32 alias count and (alias, target) string pairs. A string is a u16 length counting a
final NUL, the bytes, the NUL. Tensors are numpy views of one memory map (no copy).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_BF16 = 5


class _Reader:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> np.ndarray:
        out = self.buf[self.pos : self.pos + n]
        if len(out) != n:
            raise ValueError("model.bin is truncated")
        self.pos += n
        return out

    def u(self, width: int) -> int:
        return int.from_bytes(self.take(width).tobytes(), "little")

    def string(self) -> str:
        return self.take(self.u(2)).tobytes()[:-1].decode()


def read_ct2(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``model.bin`` -> ({CT2 name: tensor}, {alias: target}); tensors view the memory map."""
    r = _Reader(np.memmap(path, dtype=np.uint8, mode="c"))  # copy-on-write: writable views
    version = r.u(4)
    if version < 5:
        raise ValueError(f"{path}: CTranslate2 model version {version} is not supported (>= 5)")
    spec = r.string()
    if "Whisper" not in spec:
        raise ValueError(f"{path}: a {spec!r} CTranslate2 model, not Whisper")
    r.u(4)  # revision
    tensors: dict[str, torch.Tensor] = {}
    for _ in range(r.u(4)):
        name = r.string()
        dims = [r.u(4) for _ in range(r.u(1))]
        dtype, nbytes = r.u(1), r.u(4)
        raw = r.take(nbytes)
        if dtype == _BF16:
            t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        elif dtype in _DTYPES:
            t = torch.from_numpy(np.asarray(raw.view(_DTYPES[dtype])))
        else:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype code {dtype}")
        tensors[name] = t.reshape(dims)
    aliases = {}
    for _ in range(r.u(4)):
        alias = r.string()
        aliases[alias] = r.string()
    return tensors, aliases


_RULES: list[tuple[str, str]] = [
    (
        r"(encoder|decoder)/layer_(\d+)/self_attention/layer_norm/",
        r"\1.layers.\2.self_attn_layer_norm.",
    ),
    (
        r"(encoder|decoder)/layer_(\d+)/self_attention/linear_1/",
        r"\1.layers.\2.self_attn.out_proj.",
    ),
    (r"decoder/layer_(\d+)/attention/layer_norm/", r"decoder.layers.\1.encoder_attn_layer_norm."),
    (r"decoder/layer_(\d+)/attention/linear_0/", r"decoder.layers.\1.encoder_attn.q_proj."),
    (r"decoder/layer_(\d+)/attention/linear_2/", r"decoder.layers.\1.encoder_attn.out_proj."),
    (r"(encoder|decoder)/layer_(\d+)/ffn/layer_norm/", r"\1.layers.\2.final_layer_norm."),
    (r"(encoder|decoder)/layer_(\d+)/ffn/linear_0/", r"\1.layers.\2.fc1."),
    (r"(encoder|decoder)/layer_(\d+)/ffn/linear_1/", r"\1.layers.\2.fc2."),
    (r"(encoder|decoder)/position_encodings/encodings", r"\1.embed_positions.weight"),
    (r"decoder/embeddings/weight", r"decoder.embed_tokens.weight"),
    (r"encoder/(conv[12])/", r"encoder.\1."),
    (r"(encoder|decoder)/layer_norm/", r"\1.layer_norm."),
]
_LEAF = {"gamma": "weight", "beta": "bias", "weight": "weight", "bias": "bias"}
_FUSED = {
    "self_attention/linear_0": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "attention/linear_1": ("encoder_attn", ("k_proj", "v_proj")),
}


def _hf_name(name: str) -> str:
    for pattern, repl in _RULES:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            head, _, leaf = new.rpartition(".")
            return f"{head}.{_LEAF.get(leaf, leaf)}" if leaf in _LEAF else new
    raise ValueError(f"unknown CTranslate2 Whisper tensor {name!r}")


def hf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of ``model.bin`` as ``(HF Whisper name without "model.", tensor)``.

    Fused q/k/v (and the decoder's fused cross-attention k/v) are split along dim 0;
    the k biases CTranslate2 stores as zeros are dropped (HF's k_proj has none); the
    tied output projection is not repeated.
    """
    tensors, _ = read_ct2(path)
    for name, t in tensors.items():
        if name == "decoder/projection/weight" or t.dim() == 0:
            continue  # tied to decoder/embeddings/weight; 0-d: spec options, not weights
        m = re.match(
            r"^(encoder|decoder)/layer_(\d+)/(self_attention/linear_0|attention/linear_1)/(weight|bias)$",
            name,
        )
        if m is None:
            yield _hf_name(name), t
            continue
        side, layer, fused, leaf = m.groups()
        module, parts = _FUSED[fused]
        for part, chunk in zip(parts, t.chunk(len(parts), dim=0)):
            if part == "k_proj" and leaf == "bias":
                continue
            yield f"{side}.layers.{layer}.{module}.{part}.{leaf}", chunk
