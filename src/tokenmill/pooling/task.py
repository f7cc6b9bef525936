"""Generate or pool? Decided once at load from the checkpoint and the user's options.

``plan_pooling(config)`` returns None for a generative model (the usual engine loads
it) or a ``PoolingPlan`` saying which model class, which pooling head and which tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidRequestError, UnsupportedModelError
from tokenmill.loader.checkpoint import Checkpoint
from tokenmill.models.registry import (
    POOLING_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    resolve_pooling_class,
)
from tokenmill.pooling.metadata import PoolerConfig, read_pooler_config

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed", "classify")


@dataclass(frozen=True)
class PoolingPlan:
    """What a pooling model is and serves."""

    checkpoint: Checkpoint
    architecture: str
    convert: str
    """embed (a vector per input) or classify (logits per input)."""
    pooler: PoolerConfig
    num_labels: int = 0
    """Classifier outputs (0 for an embedding model)."""
    causal: bool = False
    """A decoder (``models/`` generative family) run as a pooling model (``causal.py``)."""
    per_token: bool = False
    """A token classifier (``*ForTokenClassification``): logits for every token."""

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What ``encode(pooling_task=...)`` may ask. score: cosine of two embeddings for
        an embedding model, the sigmoid of one logit for a one-label classifier."""
        if self.convert == "embed":
            return ("embed", "token_embed", "score")
        if self.per_token:
            return ("token_classify",)
        return ("classify", "score") if self.num_labels == 1 else ("classify",)

    @property
    def task(self) -> str:
        """The task ``/v1/models`` reports: embed, score (cross-encoder) or classify."""
        if self.convert == "embed":
            return "embed"
        if self.per_token:
            return "token_classify"
        return "score" if self.num_labels == 1 else "classify"


def check_runner_options(runner: str, convert: str) -> None:
    if runner not in RUNNERS:
        raise InvalidRequestError(f"runner={runner!r} is unknown; use one of {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise InvalidRequestError(
            f"convert={convert!r} is unknown; use one of {', '.join(CONVERTS)}"
        )
    if runner == "generate" and convert != "auto":
        raise InvalidRequestError(
            f"convert={convert!r} turns a model into a pooling model; it needs runner='pooling' "
            "or 'auto', not 'generate'"
        )


def plan_pooling(config: EngineConfig) -> PoolingPlan | None:
    """None: load for generation. Reads only config files (no weights)."""
    runner, convert = config.runner, config.convert
    if runner == "generate" or config.model is None:
        return None
    path = Path(config.model).expanduser()
    if not (path / "config.json").is_file():  # a GGUF, or something the loader will explain
        if runner == "pooling" or convert != "auto":
            raise UnsupportedModelError(
                f"{path} is not a Hugging Face folder; pooling models load from a folder with "
                "config.json and model.safetensors"
            )
        return None
    from tokenmill.loader.resolve import load_checkpoint

    wants_pooling = runner == "pooling" or convert != "auto" or config.pooler_config is not None
    if not wants_pooling and not _looks_like_pooling(path):
        return None
    checkpoint = load_checkpoint(str(path))
    archs = list(checkpoint.hf_config.get("architectures") or [])
    arch = next((a for a in archs if a in POOLING_ARCHITECTURES), None)
    causal = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    st_folder = (path / "modules.json").is_file()  # Qwen3-Embedding ships one
    if arch is None and causal is not None and (wants_pooling or st_folder):
        return _causal_plan(config, checkpoint, causal, path)
    if arch is None:
        if not wants_pooling:
            return None  # sentence-transformers files around a generative model: generate
        raise UnsupportedModelError(
            f"architectures {archs} can not run as a pooling model here; supported: "
            f"{', '.join(POOLING_ARCHITECTURES)} (use runner='generate' to generate)"
        )
    model_cls = resolve_pooling_class(arch)
    is_classifier = bool(getattr(model_cls, "has_classifier", False))
    if convert == "auto":
        convert = "classify" if is_classifier else "embed"
    if convert == "classify" and not is_classifier:
        raise UnsupportedModelError(
            f"convert='classify' needs a checkpoint with a classifier head; {arch} has none "
            "(use convert='embed')"
        )
    pooler = read_pooler_config(path, checkpoint.hf_config, config.pooler_config)
    num_labels = _num_labels(checkpoint.hf_config) if convert == "classify" else 0
    per_token = convert == "classify" and bool(getattr(model_cls, "per_token", False))
    return PoolingPlan(checkpoint, arch, convert, pooler, num_labels, per_token=per_token)


def _causal_plan(
    config: EngineConfig, checkpoint: Checkpoint, arch: str, path: Path
) -> PoolingPlan:
    """A decoder as an embedding model (last token) or a yes/no reranker."""
    pooler = read_pooler_config(path, checkpoint.hf_config, config.pooler_config, "LAST")
    convert = config.convert if config.convert != "auto" else "embed"
    if convert == "classify" and pooler.classifier_from_token is None:
        raise UnsupportedModelError(
            f"convert='classify' on the decoder {arch} needs the reranker's two tokens: "
            "pooler_config={'classifier_from_token': ['no', 'yes']}"
        )
    num_labels = 1 if convert == "classify" else 0
    return PoolingPlan(checkpoint, arch, convert, pooler, num_labels, causal=True)


def _looks_like_pooling(path: Path) -> bool:
    """Cheap first look: sentence-transformers files, or an encoder architecture."""
    if (path / "modules.json").is_file():
        return True
    import json

    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False  # the loader reports a broken config.json
    return any(a in POOLING_ARCHITECTURES for a in archs)


def _num_labels(hf_config: dict) -> int:
    return len(hf_config.get("id2label") or {}) or int(hf_config.get("num_labels", 2))
