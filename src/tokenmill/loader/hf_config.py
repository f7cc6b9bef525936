"""One spelling of ``hf_config`` for every source: transformers' ``to_dict()`` plus flat aliases.

transformers 5 folds ``rope_theta``/``rope_scaling`` into ``rope_parameters`` (nested per
layer type for Gemma3); configs written by transformers 4 have the flat keys. Both
spellings are present in the result, so model code may read either.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.errors import ModelLoadError

try:
    from huggingface_hub.errors import StrictDataclassClassValidationError as _INVALID
except ImportError:  # older huggingface_hub: transformers raises ValueError instead

    class _INVALID(Exception):  # type: ignore[no-redef]
        """Never raised."""


logger = logging.getLogger(__name__)

# Keys of a per-layer-type ``rope_parameters`` (Gemma3): which alias each one feeds.
_FULL, _SLIDING = "full_attention", "sliding_attention"


def normalize_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Fill class defaults through the transformers config class of ``model_type``, add aliases.

    A ``model_type`` transformers does not know is passed through unchanged (the
    model registry rejects it later with the list of supported architectures).
    """
    config = _through_transformers(raw)
    _add_rope_aliases(config)
    if config.get("head_dim") is None and config.get("num_attention_heads"):
        config["head_dim"] = int(config["hidden_size"]) // int(config["num_attention_heads"])
    return config


def _through_transformers(raw: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoConfig

    model_type = str(raw.get("model_type") or "")
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **kwargs).to_dict()
    except _INVALID as e:  # transformers' own validators: the config contradicts itself
        message = " ".join(str(e).split())
        raise ModelLoadError(f"the model's config is inconsistent: {message}") from None
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("config.json of model_type %r kept as written: %s", model_type, e)
        return dict(raw)
    if raw.get("architectures"):
        config["architectures"] = list(raw["architectures"])
    for key in _KEPT_AS_WRITTEN:  # a config class may replace a bad value by its default
        if key in raw:
            config[key] = raw[key]
    return config


_KEPT_AS_WRITTEN = ("layer_types",)
"""Keys taken from config.json as written: transformers' Qwen3.5 config silently swaps a
``layer_types`` with an unknown entry for its default pattern, which would run another
model than the checkpoint's; the model's own check names the bad entry instead."""


def _add_rope_aliases(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict):
        return
    if _FULL in rope or _SLIDING in rope:
        if config.get("rope_local_base_freq") is None:
            config["rope_local_base_freq"] = rope.get(_SLIDING, {}).get("rope_theta")
        rope = rope.get(_FULL, {})
    if config.get("rope_theta") is None and rope.get("rope_theta") is not None:
        config["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
