"""Hugging Face folders: config.json + model.safetensors (or shards listed in an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.errors import ModelLoadError
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.loader.hf_config import normalize_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class SafetensorsWeights:
    """Streams tensors shard by shard with ``safe_open`` (memory-mapped): one tensor in memory."""

    files: tuple[Path, ...]

    def iter_weights(
        self, dtype: torch.dtype, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Safetensors hold dense tensors only: ``keep_quantized`` changes nothing."""
        for file in self.files:
            with _open(file) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    # .to() copies unless dtype already matches; safe_open tensors own their memory.
                    yield name, f.get_tensor(name).to(dtype).contiguous()


def load_hf_checkpoint(folder: Path) -> Checkpoint:
    """Read config.json, generation_config.json and check the safetensors files up front."""
    raw = _read_json(folder / "config.json", what="config.json", required=True)
    files = _weight_files(folder)
    return Checkpoint(
        path=str(folder),
        format="hf",
        hf_config=normalize_hf_config(raw),
        generation_config=_read_json(
            folder / "generation_config.json", what="generation_config.json", required=False
        ),
        source=SafetensorsWeights(files),
    )


def _read_json(path: Path, *, what: str, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if not required:
            return {}
        raise ModelLoadError(
            f"{path.parent} has no {what}: a Hugging Face model folder needs config.json next "
            "to its *.safetensors (or pass a .gguf file instead)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); restore the file") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return _special_floats(data)


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(value: Any) -> Any:
    """transformers writes the floats JSON has no literal for as ``{"__float__": "Infinity"}``
    (Mamba2's default ``time_step_limit`` is (0, inf)); read them back as floats."""
    if isinstance(value, dict):
        tag = value.get("__float__") if len(value) == 1 else None
        if isinstance(tag, str) and tag in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[tag]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def _weight_files(folder: Path) -> tuple[Path, ...]:
    if (folder / INDEX_FILE).is_file():
        return _sharded_files(folder)
    if (folder / SINGLE_FILE).is_file():
        _check_readable(folder / SINGLE_FILE, None)
        return (folder / SINGLE_FILE,)
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    found = f" (found: {', '.join(others)})" if others else ""
    raise ModelLoadError(
        f"{folder} has no {SINGLE_FILE} and no {INDEX_FILE}{found}; save the model with "
        "save_pretrained(..., safe_serialization=True) -- only safetensors checkpoints load"
    )


def _sharded_files(folder: Path) -> tuple[Path, ...]:
    index = _read_json(folder / INDEX_FILE, what=INDEX_FILE, required=True)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{folder / INDEX_FILE} has no 'weight_map'; restore the file")
    by_shard: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(name)
    missing = sorted(s for s in by_shard if not (folder / s).is_file())
    if missing:
        raise ModelLoadError(
            f"{INDEX_FILE} in {folder} lists shard(s) that are not there: {', '.join(missing)}; "
            "download or copy the missing files"
        )
    for shard, names in sorted(by_shard.items()):
        _check_readable(folder / shard, names)
    return tuple(folder / s for s in sorted(by_shard))


def _check_readable(file: Path, expected: set[str] | None) -> None:
    """Open the header (cheap: memory-mapped) so a corrupt file fails before any weight loads."""
    with _open(file) as f:
        absent = sorted((expected or set()) - set(f.keys()))
    if absent:
        raise ModelLoadError(
            f"{file.name} does not contain {len(absent)} tensor(s) that {INDEX_FILE} puts in it "
            f"(e.g. {absent[0]}); the index and the shards come from different saves"
        )


def _open(file: Path):  # -> safetensors' context manager
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(
            f"{file} is not a readable safetensors file ({e}); it is truncated or corrupt: "
            "download or save it again"
        ) from e
