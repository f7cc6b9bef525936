"""One safetensors file of a model's final tensors, every tensor 64-byte aligned.

The file is plain safetensors (``safe_open`` reads it; the header lists every tensor), written
here rather than by ``safetensors.torch.save_file`` so that each tensor starts on a 64-byte
boundary: a mapped tensor then sits at the same alignment as a freshly allocated one, and
kernels whose blocking follows the address (BLAS sgemm) compute the same bits warm and
cold. Gaps are explicit ``__pad__.N`` uint8 tensors (the format allows no holes).
Reading maps the file (``safe_open``: one private mapping, no copy) and returns views.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 64
PAD_PREFIX = "__pad__."
_SLICE = 16 << 20  # bytes hashed / written per call

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``tensors`` to ``path``, each 64-byte aligned; return the file's sha256 (hex),
    hashed as it is written: the manifest needs it, and reading a model's weights back to
    hash them was as long as writing them. A tensor on another device is copied to the CPU
    one at a time."""
    entries, offset, pads = {}, 0, 0
    order: list[tuple[str, torch.Tensor | int]] = []
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        order.append((name, t))
        offset += nbytes
        gap = -offset % ALIGN
        if gap:
            pad = f"{PAD_PREFIX}{pads}"
            entries[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append((pad, gap))
            offset, pads = offset + gap, pads + 1
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)  # the data starts 64-byte aligned
    digest = hashlib.sha256()
    # the hash runs on a second thread, in order, while this one writes: both release the
    # GIL, so hashing a 1.7 GB bundle (~0.9 s) hides behind its write
    with path.open("wb") as f, ThreadPoolExecutor(1) as hasher:

        def put(data) -> None:
            view = memoryview(data).cast("B")
            for start in range(0, len(view), _SLICE):
                piece = view[start : start + _SLICE]
                hasher.submit(digest.update, piece)
                f.write(piece)

        put(struct.pack("<Q", len(header)))
        put(header)
        for _, item in order:
            if isinstance(item, int):
                put(bytes(item))
            else:  # a byte view of the tensor's memory: no copy of the weights
                put(item.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def map_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(name -> tensor viewing the mapped file, metadata). Nothing is read until touched."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = [n for n in f.keys() if not n.startswith(PAD_PREFIX)]
        return {n: f.get_tensor(n) for n in names}, f.metadata() or {}
