"""A lazy GGUF header reader: metadata and tensor table, tensor bytes memory-mapped.

``gguf.GGUFReader`` builds a numpy view per element of every metadata array, which
costs 3 s for SmolLM2's 49k-token vocabulary and 12 s for Gemma3's 262k. Loading a
model needs none of those strings (the tokenizer is converted once and cached), so
this reader walks string arrays without decoding them and keeps only their length.
Tensor bytes are handed to ``gguf.quants.dequantize`` exactly as ``GGUFReader``
would hand them (a uint8 view, one row of blocks per row).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.errors import ModelLoadError, UnsupportedModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_NESTING = 8
"""Arrays of arrays deeper than this are refused (llama.cpp writes none; a crafted file
nested thousands deep overflowed Python's recursion limit)."""
# GGUF metadata value type -> struct format of one fixed-size value.
_SCALAR_FORMATS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}  # fmt: skip


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, left undecoded: only its length is kept."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]
    """Torch order, e.g. [out_features, in_features] (GGUF stores dimensions reversed)."""
    qtype: GGMLQuantizationType
    offset: int
    """Absolute offset of the first byte in the file."""
    nbytes: int

    @property
    def row_bytes_shape(self) -> tuple[int, ...]:
        """Shape of the raw uint8 view: the leading dims, then the bytes of one row."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block_size * type_size)


@dataclass(frozen=True)
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    """Scalars, strings and numeric arrays as Python values; string arrays as ``StringArray``."""
    tensors: tuple[GgufTensorInfo, ...]
    _blob: np.ndarray = field(repr=False, compare=False)

    def raw(self, info: GgufTensorInfo) -> np.ndarray:
        """Read-only uint8 view of one tensor's bytes (memory-mapped; nothing read yet)."""
        return self._blob[info.offset : info.offset + info.nbytes].reshape(info.row_bytes_shape)

    def release(self, info: GgufTensorInfo) -> None:
        """Drop the mapped pages of the file up to the end of ``info`` from this process's
        resident memory once it is consumed, so loading never holds the file and the model
        at once (the pages stay in the OS page cache; a later read maps them back). The
        whole prefix goes, not just this tensor: the kernel maps page-cache folios of up to
        2 MB around every fault, which pulls neighbouring tensors back in."""
        mapping = getattr(self._blob, "_mmap", None)
        if mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED, 0, info.offset + info.nbytes)


def read_gguf(path: Path) -> GgufFile:
    """Parse the header of ``path``; ModelLoadError if it is not a readable GGUF v2/v3 file."""
    try:
        blob = np.memmap(path, mode="r", dtype=np.uint8)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"can not read {path}: {e}") from e
    try:
        return _parse(path, blob)
    except (ModelLoadError, UnsupportedModelError):
        raise
    except (
        struct.error,
        UnicodeDecodeError,
        IndexError,
        OverflowError,
        ValueError,
        MemoryError,
    ) as e:
        raise ModelLoadError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); download or assemble "
            "the file again"
        ) from e


def _parse(path: Path, blob: np.ndarray) -> GgufFile:
    if bytes(blob[:4]) != _MAGIC:
        raise ModelLoadError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")
    header = blob.data  # a memoryview: struct reads straight from the map
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", header, 4)
    if version not in _VERSIONS:
        raise ModelLoadError(f"{path} is GGUF v{version}; only v2 and v3 are read: re-convert it")
    reader = _Cursor(header, 24)
    reader.need(n_kv, 12, "metadata table")
    reader.need(n_tensors, 24, "tensor table")
    metadata = {reader.string(): reader.value() for _ in range(n_kv)}
    entries = [reader.tensor_entry() for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment % 8
    ):
        raise ModelLoadError(
            f"{path} has general.alignment = {alignment!r}; GGUF requires a "
            "positive multiple of 8: the file is corrupt"
        )
    data_start = -(-reader.pos // alignment) * alignment
    tensors = tuple(_tensor_info(path, data_start, *entry) for entry in entries)
    end = max((t.offset + t.nbytes for t in tensors), default=data_start)
    if end > len(blob):
        raise ModelLoadError(
            f"{path} is truncated: its tensors need {end} bytes, the file has {len(blob)}; "
            "download or assemble it again"
        )
    return GgufFile(path, metadata, tensors, blob)


def _tensor_info(
    path: Path, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int
) -> GgufTensorInfo:
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(
            f"tensor {name} of {path} has ggml type id {type_id}, unknown to the installed gguf "
            "package; upgrade gguf or re-quantize the model"
        ) from None
    shape = tuple(reversed(dims))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block_size:
        raise ModelLoadError(
            f"tensor {name} of {path} has shape {shape}, whose rows are not "
            f"whole {qtype.name} blocks of {block_size}: the file is corrupt"
        )
    nbytes = prod(shape) // block_size * type_size
    return GgufTensorInfo(name, shape, qtype, data_start + offset, nbytes)


class _Cursor:
    """Sequential little-endian reads over the header."""

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def need(self, count: int, item_bytes: int, what: str) -> None:
        """Refuse a count whose items can not fit in the bytes left (before looping on it)."""
        left = len(self.buf) - self.pos
        if count * item_bytes > left:
            raise ModelLoadError(
                f"a GGUF {what} of {count} items at byte {self.pos} needs at "
                f"least {count * item_bytes} bytes; {left} are left: the file "
                "is truncated or corrupt"
            )

    def string(self) -> str:
        (length,) = self.unpack("Q")
        self.need(length, 1, "string")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.buf[start : self.pos]).decode("utf-8")

    def value(self, type_id: int | None = None, depth: int = 0) -> Any:
        if type_id is None:
            (type_id,) = self.unpack("I")
        if type_id in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[type_id])[0]
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array(depth + 1)
        raise ModelLoadError(f"unknown GGUF metadata value type {type_id} at byte {self.pos}")

    def array(self, depth: int = 1) -> Any:
        if depth > _MAX_ARRAY_NESTING:
            raise ModelLoadError(
                f"GGUF metadata arrays nested deeper than {_MAX_ARRAY_NESTING} "
                f"at byte {self.pos}: the file is corrupt"
            )
        item_type, count = self.unpack("IQ")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            self.need(count, struct.calcsize(fmt), "metadata array")
            return list(self.unpack(f"{count}{fmt}"))
        if item_type == _STRING:
            self.need(count, 8, "string array")
            for _ in range(count):  # variable length: walk it, decode nothing
                (length,) = struct.unpack_from("<Q", self.buf, self.pos)
                self.pos += 8
                self.need(length, 1, "string")
                self.pos += length
            return StringArray(count)
        self.need(count, 12 if item_type == _ARRAY else 1, "metadata array")
        return [self.value(item_type, depth) for _ in range(count)]

    def tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        (n_dims,) = self.unpack("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelLoadError(
                f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to "
                f"{_MAX_DIMS}): the file is corrupt"
            )
        dims = self.unpack(f"{n_dims}Q")
        type_id, offset = self.unpack("IQ")
        return name, dims, type_id, offset
