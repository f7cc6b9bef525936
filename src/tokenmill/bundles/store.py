"""A prepared bundle on disk: write one from a cold load, map one back into a ready model.

A bundle is a folder::

    manifest.json        key, versions, model, sizes and sha256 of every file, created / last used
    weights.safetensors  every parameter and buffer in its final layout (``tensor_file.py``)
    config.json          the checkpoint's resolved config and generation config, the load's
                         resolution (model class, dtype, quantization, max_model_len), aliases
    tokenizer/           the HF tokenizer as loaded (converted from a GGUF's metadata once), in
                         the fast form where it loads back equal (``hf_folder.save_fast``)

Reading (``read_bundle``) checks the manifest (format and tokenmill version, then each file's
size and checksum; a checksum is skipped while the file's stat stamp shows no write since it
was verified) and builds the model unfilled with the kernels of the cold load
(``select_ops`` with the same inputs), then assigns the mapped tensors: no weight is read,
converted or copied until a kernel touches it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from gguf import GGMLQuantizationType as Q

import tokenmill
from tokenmill.bundles.capture import assign_tensors, check_capturable, model_tensors
from tokenmill.bundles.fingerprint import FORMAT_VERSION
from tokenmill.bundles.phases import Phases
from tokenmill.bundles.tensor_file import map_tensors, write_tensors
from tokenmill.config import DTYPES
from tokenmill.errors import ModelLoadError
from tokenmill.layers.ops import select_ops
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.models import resolve_model_class
from tokenmill.models.base import CausalLM
from tokenmill.quant.dense16 import move_float32_to_native, moved_to_native
from tokenmill.quant.plan import build_plan
from tokenmill.tokenizer import Tokenizer, load_tokenizer
from tokenmill.tokenizer.hf_folder import save_fast

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

MANIFEST, WEIGHTS, CONFIG, TOKENIZER = (
    "manifest.json",
    "weights.safetensors",
    "config.json",
    "tokenizer",
)
_CHUNK = 1 << 24


class StaleBundleError(ModelLoadError):
    """A bundle written by another tokenmill version or bundle format."""


class CorruptBundleError(ModelLoadError):
    """A bundle whose files do not match their manifest (truncated, edited, partial)."""


class Prepared(NamedTuple):
    """What a load computes, in ``engine.loading.LoadedModel``'s field order."""

    checkpoint: Checkpoint
    model: CausalLM
    tokenizer: Tokenizer
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    quantization: str
    phases: dict[str, float]


@dataclass
class Manifest:
    key: str
    model: str
    format_version: int = FORMAT_VERSION
    tokenmill_version: str = tokenmill.__version__
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Relative path -> {"size", "sha256", "stat"} ("stat": ``_stamp`` when the checksum
    was last verified)."""
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)

    @property
    def size(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def save(self, folder: Path) -> None:
        tmp = folder / f".{MANIFEST}.{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(folder / MANIFEST)  # atomic: readers see the old or the new one

    @classmethod
    def load(cls, folder: Path) -> Manifest:
        try:
            return cls(**json.loads((folder / MANIFEST).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise CorruptBundleError(f"bundle {folder} has no readable manifest ({e})") from e


def write_bundle(folder: Path, key: str, loaded: Prepared, config: EngineConfig) -> Manifest:
    """Write ``loaded`` (a cold load of ``config``) into the empty ``folder``."""
    check_capturable(loaded.model)
    tensors, aliases = model_tensors(loaded.model)
    digests = {WEIGHTS: write_tensors(folder / WEIGHTS, tensors, {"key": key})}
    ckpt = loaded.checkpoint
    resolved = {
        "path": ckpt.path, "format": ckpt.format, "hf_config": ckpt.hf_config,
        "generation_config": ckpt.generation_config,
        "model_class": type(loaded.model).__name__, "max_model_len": loaded.max_model_len,
        "dtype": str(loaded.dtype).removeprefix("torch."), "quantization": loaded.quantization,
        "attention_backend": config.attention_backend, "aliases": aliases,
        "stored_types": {k: int(v) for k, v in _tensor_types(ckpt).items()},
        "native_float32": moved_to_native(loaded.model),  # layers moved after the load
    }  # fmt: skip
    (folder / CONFIG).write_text(json.dumps(resolved, indent=1))
    _save_tokenizer(loaded.tokenizer.hf, folder / TOKENIZER)
    manifest = Manifest(key=key, model=ckpt.path)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = str(path.relative_to(folder))
        digest = digests.get(rel) or _sha256(path)
        manifest.files[rel] = {"size": path.stat().st_size, "sha256": digest, "stat": _stamp(path)}
    manifest.save(folder)
    return manifest


def check_bundle(folder: Path, pinned: bool = False) -> Manifest:
    """The manifest of ``folder`` after checking versions, sizes and checksums.

    Raises StaleBundleError (another version or format; with ``pinned``, the message names
    both versions and what to do) or CorruptBundleError.
    """
    manifest = Manifest.load(folder)
    if (manifest.format_version, manifest.tokenmill_version) != (
        FORMAT_VERSION,
        tokenmill.__version__,
    ):
        hint = f"; load {manifest.model} with prepare_bundle=True to build one" if pinned else ""
        raise StaleBundleError(
            f"bundle {folder} was built by tokenmill {manifest.tokenmill_version} (bundle format "
            f"{manifest.format_version}); this is tokenmill {tokenmill.__version__} (format "
            f"{FORMAT_VERSION}){hint}"
        )
    for rel, entry in manifest.files.items():
        path = folder / rel
        size = path.stat().st_size if path.is_file() else -1
        if size == entry["size"] and entry.get("stat") == _stamp(path):
            continue  # unchanged since its checksum was verified: no need to read it again
        if size != entry["size"] or _sha256(path) != entry["sha256"]:
            raise CorruptBundleError(
                f"bundle file {path} does not match its manifest (size {size}, expected "
                f"{entry['size']}, or a different checksum)"
            )
        entry["stat"] = _stamp(path)  # verified: saved with the manifest's last_used
    return manifest


def read_bundle(
    folder: Path, config: EngineConfig, model_path: str, phases: Phases | None = None
) -> Prepared:
    """The ready model of a checked bundle (``check_bundle``); weights stay mapped."""
    phases = phases or Phases()
    with phases("resolve"):
        resolved = json.loads((folder / CONFIG).read_text())
        hf_config, dtype = resolved["hf_config"], DTYPES[resolved["dtype"]]
        device, quantization = config.torch_device(), resolved["quantization"]
        ckpt = Checkpoint(model_path, resolved["format"], hf_config, resolved["generation_config"],
                          source=_ColdSource(model_path))  # fmt: skip
        model_cls = resolve_model_class(hf_config.get("architectures"))
        gguf = quantization == "gguf"
        plan = build_plan(
            quantization,
            {k: Q(v) for k, v in resolved["stored_types"].items()} if gguf else {},
            config.activation_precision,
        )
    with phases("kernels"):
        ops = select_ops(device, dtype, plan, resolved["attention_backend"])  # as built
    with phases("weights"):
        kwargs = {"quant": plan} if plan else {}
        model = _build_unfilled(model_cls, hf_config, dtype, resolved["max_model_len"], ops, kwargs)
        if resolved.get("native_float32"):  # as the cold load moved them, tiles unfilled
            move_float32_to_native(model, planned=bool(plan), fill=False)
        tensors, _ = map_tensors(folder / WEIGHTS)
        assign_tensors(model, tensors, resolved["aliases"])
        model.eval()
    with phases("tokenizer"):
        tokenizer = load_tokenizer(ckpt, str(folder / TOKENIZER))
    phases.log(f"model ready (warm, mapped from {folder})")
    return Prepared(ckpt, model, tokenizer, resolved["max_model_len"], dtype, device, quantization,
                    phases.seconds)  # fmt: skip


def _build_unfilled(model_cls, hf_config, dtype, max_model_len, ops, kwargs) -> CausalLM:
    """The model with uninitialized storage, every tensor of it replaced by a mapped one next.

    Built on the CPU, not the meta device: ``torch.empty`` only reserves address space (no
    page is touched, so no memory is used before the assignment frees it), while meta
    tensors route some ops (the rotary tables' division) through Python references whose
    first use imports ``torch._dynamo``: seconds, more than the whole warm load.
    """
    with torch.device("cpu"):
        return model_cls(hf_config, dtype, max_positions=max_model_len, ops=ops, **kwargs)


def _save_tokenizer(tokenizer, target: Path) -> None:
    """The tokenizer in the form that loads fastest: a GGUF's converted tokenizer loaded
    from its cache is already in it and is copied (saving and checking Gemma3's 262k-token
    vocabulary again took 4 s of its first start); any other is saved by ``save_fast``."""
    # imported here: it imports transformers' auto classes (0.6 s a warm start never needs)
    from tokenmill.tokenizer.gguf_tokenizer import cached_folder

    cached = cached_folder(tokenizer)
    if cached is not None:
        shutil.copytree(cached, target)
    else:
        save_fast(tokenizer, target)


def _tensor_types(ckpt: Checkpoint) -> dict:
    """HF tensor name -> GGML type of a GGUF checkpoint (what its quantization plan reads)."""
    types = getattr(ckpt.source, "tensor_types", None)
    return types() if types is not None else {}


class _ColdSource:
    """The original checkpoint's weight stream, opened only if something asks for it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def iter_weights(self, dtype: torch.dtype, keep_quantized: bool = False):
        from tokenmill.loader import load_checkpoint

        return load_checkpoint(self.path).weights(dtype, keep_quantized)


def _stamp(path: Path) -> list[int]:
    """What changes whenever a file's bytes are written, replaced or moved in: size,
    modification and status-change times, inode. A file whose stamp equals the one taken
    when its checksum matched has not been written since (the status-change time can not
    be set back by a user), so a warm start reads none of its bytes to check it: hashing
    a 1.5B model's weights cost about a second of every start. Bytes that decay on the
    disk without any write are the one change this does not see."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
