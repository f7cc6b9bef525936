"""The key of a prepared bundle: a hash over everything that changes what a load computes.

Two loads with the same key build the same tensors, bit for bit. The key is computed
without parsing the checkpoint (a GGUF's metadata takes about a second to read): the
model's files enter by identity (size + mtime_ns, and the content of small files), so
an HF folder's ``config.json`` is hashed by content and its architecture and shape/math
fields also enter by name; a GGUF's config is a function of its bytes and of the
tokenmill version, both in the key. Options that only change scheduling or the KV cache
(``max_num_seqs``, ``seed``, ``block_size``, ...) are not inputs, so they keep the key.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
import transformers

import tokenmill
from tokenmill.env import TOKENMILL_BF16_KERNEL, TOKENMILL_FP32_GEMM
from tokenmill.loader.resolve import resolve_model

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

FORMAT_VERSION = 2
"""Layout of a bundle on disk (``store.py``); bump it when that layout changes."""

SMALL_FILE_BYTES = 1 << 20
"""Files up to this size enter the key by content hash, larger ones by size + mtime_ns."""

IGNORED_CONFIG_FIELDS = frozenset(
    {"_name_or_path", "transformers_version", "use_cache", "output_attentions",
     "output_hidden_states", "return_dict", "_commit_hash", "_attn_implementation_autoset"}
)  # fmt: skip
"""config.json fields that never change shapes or math. Every other field is an input:
a field the key includes needlessly costs a rebuild, one it misses reuses wrong tensors."""

ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip
"""CPU features that select the native kernels or their tile formats (``native/``)."""


@dataclass(frozen=True)
class FileIdentity:
    """One file of the model: its name in the folder, size, mtime and (small files) content."""

    name: str
    size: int
    mtime_ns: int
    sha256: str | None


@dataclass(frozen=True)
class BundleInputs:
    """Everything the key covers; ``fingerprint`` hashes it. Each field changes the bundle."""

    architecture: str
    """``architectures`` of an HF config.json ("" for a GGUF: its file identity covers it)."""
    model_config: str
    """The shape/math fields of an HF config.json as canonical JSON ("" for a GGUF)."""
    files: tuple[FileIdentity, ...]
    """The checkpoint's files (and a tokenizer override's)."""
    dtype: str
    quantization: str
    device: str
    """Device kind: cpu, or cuda with its compute capability."""
    cpu_features: tuple[str, ...]
    """The ``ISA_FLAGS`` this CPU has, and whether the native kernels run."""
    native_isa: str
    """The ISA level the native kernels are built for (``native.default_isa()``, which
    ``TOKENMILL_NATIVE_ISA`` sets): their tile formats and summation order follow it
    ("" where they run none)."""
    tokenmill_version: str
    torch_version: str
    """PyTorch's packed int4/int8 layouts (the fallback kernels) follow its version."""
    transformers_version: str
    """The tokenizer saved in the bundle (a GGUF's converted by transformers' converter, the
    special tokens and chat template as its tokenizer classes resolve them)."""
    tokenizers_version: str
    """The Rust tokenizer pipeline serialized into the bundle's tokenizer.json."""
    format_version: int
    layout: str
    """Load options that change tensors: max_model_len (rotary tables), attention_backend
    (the kernels and norms chosen), tokenizer override path, and the kernel choices of
    ``TOKENMILL_FP32_GEMM`` / ``TOKENMILL_BF16_KERNEL``; canonical JSON.
    (``TOKENMILL_SCAN_KERNEL`` is not: the scans hold no tensors and a warm load selects
    them again.)"""


def fingerprint(inputs: BundleInputs) -> str:
    """A 32-hex-digit key of ``inputs``."""
    text = json.dumps(asdict(inputs), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def bundle_inputs(config: EngineConfig) -> BundleInputs:
    """The key inputs of loading ``config`` (reads file stats and small files only)."""
    path, fmt = resolve_model(config.model)
    hf = _json(path / "config.json") if fmt == "hf" else {}
    files = _identities(path)
    if config.tokenizer:
        files += _identities(Path(config.tokenizer).expanduser(), prefix="tokenizer/")
    layout = {
        "max_model_len": config.max_model_len,
        "attention_backend": config.attention_backend,
        "tokenizer": str(Path(config.tokenizer).expanduser().resolve())
        if config.tokenizer
        else None,
        "format": fmt,
        # kernel choices made at load that change the stored tensors: float32 weights
        # repacked into the native kernel's tiles, the bfloat16 kernel's layout
        "fp32_gemm": TOKENMILL_FP32_GEMM.get(),
        "bf16_kernel": TOKENMILL_BF16_KERNEL.get(),
    }
    return BundleInputs(
        architecture=",".join(hf.get("architectures") or []),
        model_config=_canonical({k: v for k, v in hf.items() if k not in IGNORED_CONFIG_FIELDS}),
        files=files,
        dtype=config.dtype,
        quantization=config.quantization,
        device=_device_kind(config.torch_device()),
        cpu_features=cpu_features(),
        native_isa=native_isa(),
        tokenmill_version=tokenmill.__version__,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        tokenizers_version=tokenizers.__version__,
        format_version=FORMAT_VERSION,
        layout=_canonical(layout),
    )


def cpu_features() -> tuple[str, ...]:
    from tokenmill import native

    flags = native._cpu_flags()  # the same /proc/cpuinfo read the kernel build keys on
    found = [f for f in ISA_FLAGS if f in flags]
    return (platform.machine(), *found, f"native={native.available()}")


def native_isa() -> str:
    """The native kernels' ISA level ("" where none runs; a bad ``TOKENMILL_NATIVE_ISA`` is
    the ValueError the kernels' build would raise). Older trees lack ``default_isa``: ""."""
    from tokenmill import native

    default_isa = getattr(native, "default_isa", None)
    return (default_isa() or "") if default_isa is not None else ""


def _device_kind(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda-sm{major}{minor}"


def _identities(path: Path, prefix: str = "") -> tuple[FileIdentity, ...]:
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple(_identity(p, prefix + p.name) for p in files)


def _identity(path: Path, name: str) -> FileIdentity:
    stat = path.stat()
    digest = None
    if stat.st_size <= SMALL_FILE_BYTES:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return FileIdentity(name, stat.st_size, stat.st_mtime_ns, digest)


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # load_checkpoint reports a bad config.json; its bytes are in the key


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
