"""HF `architectures` name -> model class, imported lazily."""

from __future__ import annotations

import importlib

from tokenmill.errors import UnsupportedModelError

# name -> (module, class). Add a family here and in its own file; nothing else changes.
_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.qwen2", "Qwen2ForCausalLM"),
    "MiMoForCausalLM": ("tokenmill.models.mimo", "MiMoForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.models.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.mistral", "MistralForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.models.gemma3", "Gemma3ForCausalLM"),
    "FalconH1ForCausalLM": ("tokenmill.models.falcon_h1", "FalconH1ForCausalLM"),
    "Lfm2ForCausalLM": ("tokenmill.models.lfm2", "Lfm2ForCausalLM"),
    "Mamba2ForCausalLM": ("tokenmill.models.mamba2", "Mamba2ForCausalLM"),
    "Qwen3_5ForCausalLM": ("tokenmill.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3NextForCausalLM": ("tokenmill.models.qwen3_5", "Qwen3NextForCausalLM"),
    "Qwen3_5ForConditionalGeneration": (
        "tokenmill.models.qwen3_5_vl",
        "Qwen3_5ForConditionalGeneration",
    ),
    "Gemma3ForConditionalGeneration": (
        "tokenmill.models.gemma3_vl",
        "Gemma3ForConditionalGeneration",
    ),
    "Qwen2VLForConditionalGeneration": (
        "tokenmill.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        "tokenmill.models.qwen2_vl",
        "Qwen2_5_VLForConditionalGeneration",
    ),
    "Qwen3VLForConditionalGeneration": (
        "tokenmill.models.qwen3_vl",
        "Qwen3VLForConditionalGeneration",
    ),
    "Qwen2AudioForConditionalGeneration": (
        "tokenmill.models.qwen2_audio",
        "Qwen2AudioForConditionalGeneration",
    ),
    "SmolVLMForConditionalGeneration": (
        "tokenmill.models.smolvlm",
        "SmolVLMForConditionalGeneration",
    ),
    "Idefics3ForConditionalGeneration": (
        "tokenmill.models.smolvlm",
        "Idefics3ForConditionalGeneration",
    ),
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


# Pooling models (embed / classify / score): encoders with no KV cache, run by
# ``tokenmill.pooling``. name -> (module, class), imported lazily like the above.
_POOLING_REGISTRY: dict[str, tuple[str, str]] = {
    name: ("tokenmill.models.bert", cls)
    for names, cls in (
        (("BertModel", "RobertaModel", "XLMRobertaModel"), "BertModel"),
        (
            (
                "BertForSequenceClassification",
                "RobertaForSequenceClassification",
                "XLMRobertaForSequenceClassification",
            ),
            "BertForSequenceClassification",
        ),
        (
            (
                "BertForTokenClassification",
                "RobertaForTokenClassification",
                "XLMRobertaForTokenClassification",
            ),
            "BertForTokenClassification",
        ),
    )
    for name in names
}
_POOLING_REGISTRY["ModernBertModel"] = ("tokenmill.models.modernbert", "ModernBertModel")
_POOLING_REGISTRY["ModernBertForSequenceClassification"] = (
    "tokenmill.models.modernbert",
    "ModernBertForSequenceClassification",
)

_POOLING_REGISTRY["Gemma3TextModel"] = ("tokenmill.models.gemma3", "Gemma3TextModel")

POOLING_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_POOLING_REGISTRY))


def resolve_pooling_class(name: str) -> type:
    """The pooling model class of one HF architecture name."""
    if name not in _POOLING_REGISTRY:
        raise UnsupportedModelError(
            f"{name!r} is not a supported pooling architecture; supported: "
            f"{', '.join(POOLING_ARCHITECTURES)}"
        )
    module, cls = _POOLING_REGISTRY[name]
    return getattr(importlib.import_module(module), cls)
