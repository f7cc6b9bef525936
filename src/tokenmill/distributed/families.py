"""What pipeline stages need to know of each causal family: where its layers, table and
final norm sit, what one stage hands the next, and how to run a stage's layers.

The decoder families (``DecoderForCausalLM``) and the hybrid / state-space ones
(Qwen3.5 / Qwen3-Next, Mamba2, LFM2, Falcon-H1) differ in names (``backbone.`` vs
``model.``), in what flows between layers (Llama-style (hidden, residual) pairs, or one
hidden whose residual was added in place; Mamba2's in float32) and in what a layer
takes (a ``StatePlan`` of the step's state slots for the recurrent ones). The vision-
and audio-language checkpoints nest one of those language models (``text_config``, its
tensors under a prefix per layout) next to an encoder, which only the driver loads and
runs (``encoder_part``). A ``Family`` says it once per family; ``stages.PPStage`` runs any
of them the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.attention import StepContext
from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.recurrent.plan import StatePlan
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig

Carry = tuple[torch.Tensor, torch.Tensor | None]
"""(hidden [T, hidden], residual [T, hidden] or None): what flows between layers."""
PAGED, STATE = "paged", "state"


@dataclass(frozen=True)
class Family:
    """One family's layout. ``*_names``: checkpoint (HF) name prefixes; ``*_attrs``:
    attribute paths on the built model."""

    layers_names: tuple[str, ...]
    """Prefixes of layer i's tensors, before ``i.``: ("model.layers.",); a vision-language
    family lists each checkpoint layout's ("model.language_model.layers.", "model.layers.")."""
    table_names: tuple[str, ...]
    final_names: tuple[str, ...]
    """The final norm and the head: the last stage's."""
    table_attr: str
    final_attrs: tuple[str, ...]
    arch: Callable[[dict[str, Any]], ArchConfig]
    """The shared sizes (layers, hidden, vocabulary, tying) from config.json."""
    kinds: Callable[[dict[str, Any]], list[frozenset[str]]]
    """Per layer, the caches it holds: PAGED (K/V blocks), STATE (a state slot)."""
    embed: Callable[[Any, torch.Tensor, StepContext], torch.Tensor]
    layers: Callable[[Any, Carry, torch.Tensor, StepContext], Carry]
    """(model, carry, positions [T], ctx) -> the carry after the stage's layers."""
    finish: Callable[[Any, Carry], torch.Tensor]
    """The last stage: the final norm -> hidden [T, hidden]."""
    pairs: bool = True
    """Stages hand on (hidden, residual); False: hidden only."""
    types_key: str | None = None
    """The config.json key of per-layer types a stage renumbers (None: none)."""
    types: Callable[[dict[str, Any]], Sequence[str]] | None = None
    carry_fp32: Callable[[dict[str, Any]], bool] = lambda hf: False
    """Whether the hidden between stages is float32 (Mamba2's ``residual_in_fp32``)."""
    text: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: hf
    """config.json -> the language model's config, which every callable above reads."""
    nest: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    """(config.json, a rank's edited language config) -> the config.json the rank builds
    from; None: a flat config (the edits are config.json itself). ``nested.NestedPart``."""
    encoder_prefixes: tuple[str, ...] = ()
    """Checkpoint name prefixes of a vision / audio encoder (tower and projector): the
    driver loads them whole (``encoder_part.EncoderPart``), no other rank reads them."""
    encoder_attrs: tuple[str, ...] = ()
    """The built model's encoder modules: the driver keeps them (it encodes media and
    broadcasts the embeddings with the step), every other rank drops them."""
    first_stage_layers: Callable[[dict[str, Any]], int] = lambda raw: 1
    """(config.json) -> the layers the first pipeline stage must hold: Qwen3-VL adds its
    DeepStack features after each of the first L layers, on the stage that embeds."""

    def layer_types(self, hf: dict[str, Any]) -> list[str] | None:
        return None if self.types is None else list(self.types(hf))


def attr(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_attr(obj: Any, path: str, value: Any) -> None:
    head, _, leaf = path.rpartition(".")
    setattr(attr(obj, head) if head else obj, leaf, value)


def _plan(ctx: StepContext) -> StatePlan | None:
    return StatePlan.of(ctx) if ctx.state is not None else None


# -- the decoder families ------------------------------------------------------------------


def _decoder_layers(model: Any, carry: Carry, positions: torch.Tensor, ctx: StepContext) -> Carry:
    hidden, residual = carry
    rope = model.model.rope_tables(positions)
    for layer in model.model.layers:
        hidden, residual = layer(rope, hidden, residual, ctx)
    return hidden, residual


DECODER = Family(
    layers_names=("model.layers.",),
    table_names=("model.embed_tokens.",),
    final_names=("model.norm.", "lm_head."),
    table_attr="model.embed_tokens",
    final_attrs=("model.norm", "lm_head"),
    arch=ArchConfig.from_hf,
    kinds=lambda hf: [frozenset({PAGED})] * ArchConfig.from_hf(hf).num_layers,
    embed=lambda model, ids, ctx: model.model.embed(ids, ctx),
    layers=_decoder_layers,
    finish=lambda model, c: model.model.norm.forward_residual(c[0], c[1])[0],
    types_key="layer_types",
    types=lambda hf: ArchConfig.from_hf(hf).layer_types,
)


# -- Qwen3.5 / Qwen3-Next: (hidden, residual) pairs, DeltaNet layers take the plan ----------


def _qwen3_5_types(hf: dict[str, Any]) -> tuple[str, ...]:
    from tokenmill.models.qwen3_5 import HybridConfig

    return HybridConfig.from_hf(hf).layer_types


def _qwen3_5_layers(model: Any, carry: Carry, positions: torch.Tensor, ctx: StepContext) -> Carry:
    hidden, residual = carry
    rope, plan = model.model.rope_tables(positions), _plan(ctx)  # [3, T]: M-RoPE (vision)
    for layer in model.model.layers:
        hidden, residual = layer(rope, hidden, residual, ctx, plan)
    return hidden, residual


def _qwen3_5_arch(hf: dict[str, Any]) -> ArchConfig:
    from tokenmill.models.qwen3_5 import HybridConfig

    return HybridConfig.from_hf(hf).arch


QWEN3_5 = Family(
    layers_names=("model.layers.",),
    table_names=("model.embed_tokens.",),
    final_names=("model.norm.", "lm_head."),
    table_attr="model.embed_tokens",
    final_attrs=("model.norm", "lm_head"),
    arch=_qwen3_5_arch,
    kinds=lambda hf: [
        frozenset({STATE if t == "linear_attention" else PAGED}) for t in _qwen3_5_types(hf)
    ],  # fmt: skip
    embed=lambda model, ids, ctx: model.model.embed(ids, ctx),
    layers=_qwen3_5_layers,
    finish=lambda model, c: model.model.norm.forward_residual(c[0], c[1])[0],
    types_key="layer_types",
    types=_qwen3_5_types,
)


# -- Mamba2: one hidden (float32 with residual_in_fp32), every layer a state slot -----------


def _mamba2_layers(model: Any, carry: Carry, positions: torch.Tensor, ctx: StepContext) -> Carry:
    hidden, plan = carry[0], _plan(ctx)
    for layer in model.layers:
        hidden = layer(hidden, ctx, plan)
    return hidden, None


def _mamba2_arch(hf: dict[str, Any]) -> ArchConfig:
    """No attention, no MLP: those sizes are placeholders nothing reads."""
    fill = {"intermediate_size": 0, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": hf["hidden_size"], "max_position_embeddings": 1 << 20,
            "tie_word_embeddings": False}  # fmt: skip
    return ArchConfig.from_hf({**fill, **hf})


MAMBA2 = Family(
    layers_names=("backbone.layers.",),
    table_names=("backbone.embeddings.", "backbone.embedding."),
    final_names=("backbone.norm_f.", "lm_head."),
    table_attr="embeddings",
    final_attrs=("norm_f", "lm_head"),
    arch=_mamba2_arch,
    kinds=lambda hf: [frozenset({STATE})] * int(hf["num_hidden_layers"]),
    embed=lambda model, ids, ctx: model.embeddings(ids),
    layers=_mamba2_layers,
    finish=lambda model, c: model.norm_f(c[0].to(model.dtype)),
    pairs=False,
    carry_fp32=lambda hf: bool(hf.get("residual_in_fp32", True)),
)


# -- LFM2 and Falcon-H1: one hidden, the residual added inside each layer -------------------


def _rope_layers(model: Any, carry: Carry, positions: torch.Tensor, ctx: StepContext) -> Carry:
    hidden, rope, plan = carry[0], model.rotary.tables(positions), _plan(ctx)
    for layer in model.layers:
        hidden = layer(rope, hidden, ctx, plan)
    return hidden, None


def _lfm2_types(hf: dict[str, Any]) -> tuple[str, ...]:
    from tokenmill.models.lfm2 import layer_types

    return layer_types(hf, int(hf["num_hidden_layers"]))


def _lfm2_arch(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig.from_hf({"rms_norm_eps": hf.get("norm_eps", 1e-5), **hf})


LFM2 = Family(
    layers_names=("model.layers.",),
    table_names=("model.embed_tokens.",),
    final_names=("model.embedding_norm.", "lm_head."),
    table_attr="embed_tokens",
    final_attrs=("embedding_norm", "lm_head"),
    arch=_lfm2_arch,
    kinds=lambda hf: [frozenset({STATE if t == "conv" else PAGED}) for t in _lfm2_types(hf)],
    embed=lambda model, ids, ctx: model.embed_tokens(ids),
    layers=_rope_layers,
    finish=lambda model, c: model.embedding_norm(c[0]),
    pairs=False,
    types_key="layer_types",
    types=_lfm2_types,
)


def _falcon_embed(model: Any, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    hidden = model.embed_tokens(ids)
    return hidden * model.embedding_multiplier if model.embedding_multiplier != 1.0 else hidden


FALCON_H1 = Family(
    layers_names=("model.layers.",),
    table_names=("model.embed_tokens.",),
    final_names=("model.final_layernorm.", "lm_head."),
    table_attr="embed_tokens",
    final_attrs=("final_layernorm", "lm_head"),
    arch=lambda hf: ArchConfig.from_hf({"tie_word_embeddings": False, **hf}),
    kinds=lambda hf: [frozenset({PAGED, STATE})] * int(hf["num_hidden_layers"]),
    embed=_falcon_embed,
    layers=_rope_layers,
    finish=lambda model, c: model.final_layernorm(c[0]),
    pairs=False,
)


# -- vision- and audio-language checkpoints: a language model nested next to an encoder ----


def nested_text(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (``text_config``, or config.json itself when flat), the
    top-level tie flag winning as transformers ties."""
    from tokenmill.models.qwen3_5_vl import vl_text_config

    return vl_text_config(hf)


def _nest(hf: dict[str, Any], text: dict[str, Any]) -> dict[str, Any]:
    """config.json with a rank's edited language config in place (the encoder's config,
    ``vision_config`` / ``audio_config``, untouched: the driver builds the whole encoder)."""
    return {**hf, "text_config": text} if hf.get("text_config") else text


def with_encoder(base: Family, language: tuple[str, ...], heads: tuple[str, ...],
                 encoder: tuple[str, ...], attrs: tuple[str, ...], **changes: Any) -> Family:  # fmt: skip
    """``base``'s layers behind ``language`` (the checkpoint prefixes of its ``model.``, one
    per layout), output ``heads``, and an encoder at ``encoder`` (checkpoint) / ``attrs``
    (built model)."""
    return dataclasses.replace(
        base,
        layers_names=tuple(p + "layers." for p in language),
        table_names=tuple(p + "embed_tokens." for p in language),
        final_names=tuple(p + "norm." for p in language) + heads,
        text=nested_text,
        nest=_nest,
        encoder_prefixes=encoder,
        encoder_attrs=attrs,
        **changes,
    )


def _deepstack_layers(model: Any, carry: Carry, positions: torch.Tensor, ctx: StepContext) -> Carry:
    """Qwen3-VL's layers: the DeepStack features of the media rows added to the stream
    after each of the first L layers (the first stage's: only it gets ``input_embeds``)."""
    embeds = ctx.input_embeds
    stack = None if embeds is None else embeds.deepstack  # [N, L, hidden]
    if stack is None:
        return _decoder_layers(model, carry, positions, ctx)
    assert embeds is not None
    hidden, residual = carry
    rope = model.model.rope_tables(positions)
    for i, layer in enumerate(model.model.layers):
        hidden, residual = layer(rope, hidden, residual, ctx)
        if i < stack.shape[1]:  # the stream as HF sums it (residual + output), + the features
            hidden = residual + hidden
            hidden[embeds.rows] += stack[:, i].to(hidden.dtype)
            residual = torch.zeros_like(hidden)
    return hidden, residual


def _deepstack_count(raw: dict[str, Any]) -> int:
    vision = raw.get("vision_config") or {}
    return len(vision.get("deepstack_visual_indexes", (8, 16, 24)))


QWEN_VL_LANGUAGE = ("model.language_model.", "model.")  # transformers 5's layout, the flat one
QWEN_VL_ENCODER = ("model.visual.", "visual.")
QWEN_VL = with_encoder(DECODER, QWEN_VL_LANGUAGE, ("lm_head.",), QWEN_VL_ENCODER, ("visual",))
QWEN3_VL = with_encoder(
    DECODER, QWEN_VL_LANGUAGE, ("lm_head.",), QWEN_VL_ENCODER, ("visual",),
    layers=_deepstack_layers, first_stage_layers=_deepstack_count,
)  # fmt: skip
GEMMA3_VL = with_encoder(
    DECODER,
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
     "multi_modal_projector."),
    ("vision",),
)  # fmt: skip
SMOLVLM = with_encoder(
    DECODER, ("model.text_model.",), ("lm_head.",), ("model.vision_model.", "model.connector."),
    ("vision",),
)  # fmt: skip
QWEN2_AUDIO = with_encoder(
    DECODER, ("language_model.model.",), ("language_model.lm_head.",),
    ("audio_tower.", "multi_modal_projector."), ("audio_tower", "multi_modal_projector"),
)  # fmt: skip
QWEN3_5_VL = with_encoder(
    QWEN3_5, ("model.language_model.",), ("lm_head.",), ("model.visual.",), ("visual",)
)
"""Qwen3.5's checkpoints: the hybrid language model under ``model.language_model.*`` (the
built model's attributes stay ``model.*``), Qwen3-VL's tower without DeepStack."""


FAMILIES: dict[str, Family] = {
    "Qwen3_5ForCausalLM": QWEN3_5,
    "Qwen3_5ForConditionalGeneration": QWEN3_5_VL,
    "Qwen2VLForConditionalGeneration": QWEN_VL,
    "Qwen2_5_VLForConditionalGeneration": QWEN_VL,
    "Qwen3VLForConditionalGeneration": QWEN3_VL,
    "Gemma3ForConditionalGeneration": GEMMA3_VL,
    "SmolVLMForConditionalGeneration": SMOLVLM,
    "Idefics3ForConditionalGeneration": SMOLVLM,
    "Qwen2AudioForConditionalGeneration": QWEN2_AUDIO,
    "Qwen3NextForCausalLM": QWEN3_5,
    "Mamba2ForCausalLM": MAMBA2,
    "Lfm2ForCausalLM": LFM2,
    "FalconH1ForCausalLM": FALCON_H1,
}
"""Model class name -> its family (the decoder families: ``DECODER``)."""


def family_of(model_cls: type[CausalLM]) -> Family:
    """The family of a model class; UnsupportedModelError for one that does not split."""
    from tokenmill.models.decoder import DecoderForCausalLM

    family = FAMILIES.get(model_cls.__name__)
    if family is not None:
        return family
    if issubclass(model_cls, DecoderForCausalLM):
        return DECODER
    raise UnsupportedModelError(
        f"{model_cls.__name__} can not be split over processes yet (tensor and pipeline "
        "parallelism cover the decoder families Llama, Qwen2, Qwen3, Mistral, Gemma3 and "
        f"{', '.join(sorted(FAMILIES))})"
    )
