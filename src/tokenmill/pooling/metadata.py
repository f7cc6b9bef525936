"""What a checkpoint says about pooling: sentence-transformers files and the HF config.

``read_pooler_config(folder, hf_config, overrides)`` is read once at load and gives a
frozen ``PoolerConfig``; nothing reads these files afterwards.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")
# sentence-transformers' Pooling config keys -> our pooling type (first true one wins).
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": "MAX",
}
# ST Dense activations by class path -> the name ``pooler.DENSE_ACTIVATIONS`` knows.
_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
}
OVERRIDABLE = (
    "pooling_type",
    "normalize",
    "activation",
    "use_activation",
    "dimensions",
    "classifier_from_token",
)
"""Keys of ``pooler_config={...}`` (vLLM's names)."""


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers ``N_Dense`` module: y = act(x W^T + b)."""

    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


@dataclass(frozen=True)
class PoolerConfig:
    """How hidden states become one vector per sequence, resolved at load."""

    pooling_type: str = "CLS"
    """CLS (first token), MEAN (over all tokens), LAST (last token), MAX (per dimension)."""
    normalize: bool = True
    """L2-normalize embeddings by default: True (vLLM's default) unless a sentence-transformers
    modules.json lists no Normalize module; pooler_config may override."""
    dense: tuple[DenseLayer, ...] = ()
    """sentence-transformers Dense layers after pooling, in order."""
    activation: bool = True
    """Classifier outputs get softmax (sigmoid for one label) by default."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Set when the config declares Matryoshka training: ``dimensions`` is then allowed
    (any value up to the full size; vLLM does not restrict it to the listed ones)."""
    is_matryoshka: bool = False
    default_dimensions: int | None = None
    """pooler_config's ``dimensions``: the size returned when a request sets none."""
    prompts: dict[str, str] = field(default_factory=dict)
    """config_sentence_transformers.json prompts (name -> text prefixed to the input)."""
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    """sentence_bert_config.json's limit; it lowers max_model_len."""
    classifier_from_token: tuple[str, str] | None = None
    """A decoder reranker's (no, yes) tokens: score = sigmoid(logit(yes) - logit(no))."""


def read_pooler_config(
    folder: Path | None,
    hf_config: dict[str, Any],
    overrides: dict[str, Any] | None,
    default_pooling_type: str = "CLS",
) -> PoolerConfig:
    """The checkpoint's pooling metadata, then ``overrides`` (``pooler_config={...}``).
    ``default_pooling_type``: CLS for encoders, LAST for decoders."""
    cfg = PoolerConfig(pooling_type=default_pooling_type)
    if folder is not None and folder.is_dir():
        cfg = _from_sentence_transformers(folder, cfg)
    dims = hf_config.get("matryoshka_dimensions")
    if hf_config.get("is_matryoshka") or dims:
        cfg = replace(cfg, is_matryoshka=True, matryoshka_dimensions=tuple(dims or ()) or None)
    return _apply_overrides(cfg, overrides or {})


def _from_sentence_transformers(folder: Path, cfg: PoolerConfig) -> PoolerConfig:
    modules = _json(folder / "modules.json")
    if isinstance(modules, list):
        cfg = replace(cfg, normalize=False)  # sentence-transformers: only with a Normalize
    dense: list[DenseLayer] = []
    for module in modules if isinstance(modules, list) else []:
        # the class name: "sentence_transformers.models.Pooling" (v2-v5) or
        # "sentence_transformers.sentence_transformer.modules.pooling.Pooling" (v6)
        kind = str(module.get("type", "")).rpartition(".")[2]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            cfg = replace(cfg, normalize=True)  # it has no files: a missing folder is fine
            continue
        if not path.is_dir():
            logger.warning(
                "modules.json lists %s (%s), which is not in %s; skipped", path.name, kind, folder
            )
            continue
        if kind == "Pooling":
            cfg = replace(cfg, pooling_type=_st_pooling_type(path / "config.json"))
        elif kind == "Dense":
            dense.append(_st_dense(path))
        else:
            logger.warning(
                "sentence-transformers module %s (%s) is not supported; skipped", path.name, kind
            )
    st = _json(folder / "config_sentence_transformers.json") or {}
    bert = _json(folder / "sentence_bert_config.json") or {}
    return replace(
        cfg,
        dense=tuple(dense),
        prompts=dict(st.get("prompts") or {}),
        default_prompt_name=st.get("default_prompt_name"),
        max_seq_length=bert.get("max_seq_length"),
    )


def _st_pooling_type(path: Path) -> str:
    conf = _json(path) or {}
    if conf.get("pooling_mode_mean_sqrt_len_tokens") or conf.get(
        "pooling_mode_weightedmean_tokens"
    ):
        raise ModelLoadError(f"{path}: mean_sqrt_len / weighted-mean pooling is not supported")
    if conf.get("include_prompt") is False:
        logger.warning(
            "%s: include_prompt=false is not supported; a prompt's tokens are pooled too", path
        )
    modes = [ours for key, ours in _ST_MODES.items() if conf.get(key)]
    if conf.get("pooling_mode"):
        modes = [
            {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "max": "MAX"}[conf["pooling_mode"]]
        ]
    if len(modes) != 1:
        raise ModelLoadError(f"{path}: exactly one pooling mode must be on, got {modes or 'none'}")
    return modes[0]


def _st_dense(path: Path) -> DenseLayer:
    conf = _json(path / "config.json") or {}
    act = str(conf.get("activation_function", "torch.nn.modules.linear.Identity"))
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{path}: Dense activation {act!r} is not supported")
    return DenseLayer(
        folder=str(path),
        in_features=int(conf["in_features"]),
        out_features=int(conf["out_features"]),
        bias=bool(conf.get("bias", True)),
        activation=_ACTIVATIONS[act],
    )


def _apply_overrides(cfg: PoolerConfig, overrides: dict[str, Any]) -> PoolerConfig:
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise InvalidRequestError(
            f"pooler_config keys {unknown} are unknown; known: {', '.join(OVERRIDABLE)}"
        )
    changes: dict[str, Any] = {}
    if "pooling_type" in overrides:
        kind = str(overrides["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooler_config pooling_type={overrides['pooling_type']!r}; use one of "
                f"{', '.join(POOLING_TYPES)}"
            )
        changes["pooling_type"] = kind
    if "normalize" in overrides:
        changes["normalize"] = bool(overrides["normalize"])
    for key in ("activation", "use_activation"):
        if key in overrides:
            changes["activation"] = bool(overrides[key])
    if "classifier_from_token" in overrides:
        tokens = overrides["classifier_from_token"]
        if not (isinstance(tokens, list | tuple) and len(tokens) == 2):
            raise InvalidRequestError(
                f"pooler_config classifier_from_token must list two tokens (no, yes), got {tokens!r}"
            )
        changes["classifier_from_token"] = (str(tokens[0]), str(tokens[1]))
    if "dimensions" in overrides:
        changes["default_dimensions"] = int(overrides["dimensions"])
        changes["is_matryoshka"] = True
    return replace(cfg, **changes)


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); restore the file") from e
