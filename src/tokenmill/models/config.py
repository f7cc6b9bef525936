"""The architecture of a checkpoint, normalized once from its Hugging Face ``config.json``.

Hugging Face spells the same thing differently across families and library
versions (``rope_theta``/``rope_scaling`` in transformers 4, ``rope_parameters``
in transformers 5, ``hidden_act`` vs ``hidden_activation``, ...). ``ArchConfig``
is the one spelling the model code reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import ModelLoadError, UnsupportedModelError
from tokenmill.layers.rotary import ROPE_SCALINGS, RopeConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)

# HF class defaults of keys that `save_pretrained` may leave out, per `model_type`.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 128},
    "gemma3_text": {
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}


@dataclass(frozen=True)
class ArchConfig:
    """Everything the shared decoder needs to know about one checkpoint."""

    model_type: str
    """HF ``model_type`` ("llama", "qwen2", "gemma3_text", ...)."""
    vocab_size: int
    """Rows of the embedding table and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the MLP's gated hidden layer."""
    num_layers: int
    """Decoder layers (HF ``num_hidden_layers``)."""
    num_heads: int
    """Query heads (HF ``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); defaults to ``num_heads``."""
    head_dim: int
    """Per-head width; defaults to hidden_size // num_heads."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope: RopeConfig
    """Rotary parameters of full-attention layers (all layers unless ``sliding_rope`` is set)."""
    sliding_rope: RopeConfig | None
    """Rotary parameters of sliding-window layers when they differ (Gemma3's local base freq)."""
    max_position_embeddings: int
    """Longest context the checkpoint supports; size of the rotary cache by default."""
    tie_word_embeddings: bool
    """Output head shares the embedding table (no ``lm_head.weight`` in the checkpoint)."""
    attention_bias: bool
    """HF ``attention_bias``: bias on q/k/v/o projections (Llama-style families)."""
    mlp_bias: bool
    """HF ``mlp_bias``: bias on gate/up/down projections (Llama)."""
    sliding_window: int | None
    """Window of sliding layers: position p sees keys k with p - window < k <= p."""
    layer_types: tuple[str, ...]
    """Per layer: "full_attention" or "sliding_attention" (only when sliding_window is set)."""
    hidden_act: str
    """Gate activation of the MLP (HF ``hidden_act`` / ``hidden_activation``)."""
    query_pre_attn_scalar: float | None
    """Gemma: attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5."""
    final_logit_softcapping: float | None
    """logits = tanh(logits / c) * c when set."""
    attn_logit_softcapping: float | None
    """Attention scores soft-capping (as written in the config; see each family for use)."""
    torch_dtype: str | None
    """Dtype the checkpoint was saved in ("bfloat16", ...), if recorded."""

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == SLIDING_ATTENTION

    def window_of(self, layer_idx: int) -> int | None:
        """Sliding window of one layer, None for full attention."""
        return self.sliding_window if self.is_sliding(layer_idx) else None

    def rope_of(self, layer_idx: int) -> RopeConfig:
        """Rotary parameters of one layer."""
        if self.is_sliding(layer_idx) and self.sliding_rope is not None:
            return self.sliding_rope
        return self.rope

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> ArchConfig:
        """Normalize a HF ``config.json`` dict (transformers 4 or 5 spelling)."""
        model_type = str(hf_config.get("model_type", ""))
        d = {**_FAMILY_DEFAULTS.get(model_type, {}), **hf_config}
        for key in _REQUIRED:
            if d.get(key) is None:
                raise ModelLoadError(f"config.json has no {key!r} (model_type={model_type!r})")
        if d.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "bidirectional (embedding) Gemma3 checkpoints are not supported"
            )
        num_layers, num_heads = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        sliding_window = d.get("sliding_window") if d.get("use_sliding_window", True) else None
        rope, sliding_rope = _parse_rope(d)
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(d.get("head_dim") or d["hidden_size"] // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=rope,
            sliding_rope=sliding_rope,
            max_position_embeddings=int(d["max_position_embeddings"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            layer_types=_layer_types(d, model_type, num_layers, sliding_window),
            hidden_act=str(d.get("hidden_activation") or d.get("hidden_act") or "silu"),
            query_pre_attn_scalar=_opt_float(d.get("query_pre_attn_scalar")),
            final_logit_softcapping=_opt_float(d.get("final_logit_softcapping")),
            attn_logit_softcapping=_opt_float(d.get("attn_logit_softcapping")),
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


# ---- rotary ---------------------------------------------------------------------------


def _parse_rope(d: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(full-attention rope, sliding-layer rope or None) from either HF spelling."""
    theta = float(d.get("rope_theta", 10000.0))
    params = d.get("rope_parameters")
    if params and any(isinstance(params.get(t), dict) for t in _LAYER_TYPES):
        by_type = {t: params[t] for t in _LAYER_TYPES if params.get(t)}  # transformers 5, per type
    elif params:
        by_type = {FULL_ATTENTION: params}  # transformers 5
    else:
        by_type = {FULL_ATTENTION: dict(d.get("rope_scaling") or {})}  # transformers 4
    if SLIDING_ATTENTION not in by_type and d.get("rope_local_base_freq") is not None:
        by_type[SLIDING_ATTENTION] = {
            "rope_theta": d["rope_local_base_freq"]
        }  # Gemma3, transformers 4
    max_pos = int(d["max_position_embeddings"])
    full = _rope_from_params(by_type.get(FULL_ATTENTION, {}), theta, max_pos)
    sliding = by_type.get(SLIDING_ATTENTION)
    return full, (_rope_from_params(sliding, theta, max_pos) if sliding else None)


def _rope_from_params(p: dict[str, Any], theta: float, max_pos: int) -> RopeConfig:
    scaling = str(p.get("rope_type", p.get("type", "default")))
    if scaling not in ROPE_SCALINGS:
        raise UnsupportedModelError(
            f"rope scaling {scaling!r} is not supported; supported: {', '.join(ROPE_SCALINGS)}"
        )
    return RopeConfig(
        theta=float(p.get("rope_theta", theta)),
        scaling=scaling,
        factor=float(p.get("factor", 1.0)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", max_pos)),
    )


# ---- layer types ----------------------------------------------------------------------


def _gemma3_layer_types(d: dict[str, Any], n: int) -> list[str]:
    """Every ``sliding_window_pattern``-th layer is global, the others local."""
    pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(n)]


def _qwen_layer_types(d: dict[str, Any], n: int) -> list[str]:
    """Qwen2/3: layers from ``max_window_layers`` on use the sliding window."""
    first = int(d.get("max_window_layers", n))
    return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]


# model_type -> layer types when config.json has no `layer_types` (and a sliding window is set).
_LAYER_TYPE_RULES: dict[str, Callable[[dict[str, Any], int], list[str]]] = {
    "gemma3_text": _gemma3_layer_types,
    "qwen2": _qwen_layer_types,
    "qwen3": _qwen_layer_types,
}


def _layer_types(
    d: dict[str, Any], model_type: str, n: int, sliding_window: int | None
) -> tuple[str, ...]:
    if sliding_window is None:
        return (FULL_ATTENTION,) * n
    given = d.get("layer_types")
    if given is None:
        rule = _LAYER_TYPE_RULES.get(model_type, lambda _d, k: [SLIDING_ATTENTION] * k)
        given = rule(d, n)
    types = tuple(str(t) for t in given)
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise UnsupportedModelError(
            f"layer_types must be {n} entries of {_LAYER_TYPES}; got {list(types)!r}"
        )
    return types
