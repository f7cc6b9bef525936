"""HF `architectures` name -> model class, imported lazily."""

from __future__ import annotations

import importlib

from tokenmill.errors import UnsupportedModelError

# name -> (module, class). Add a family here and in its own file; nothing else changes.
_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.mistral", "MistralForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_REGISTRY))


def resolve_model_class(architectures: list[str] | None) -> type:
    """Return the class for the first supported name in ``architectures``."""
    for name in architectures or []:
        if name in _REGISTRY:
            module, cls = _REGISTRY[name]
            return getattr(importlib.import_module(module), cls)
    raise UnsupportedModelError(
        f"model architecture {architectures!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
