"""A rank's part of a vision- or audio-language checkpoint whose language model is nested:
config.json keeps it under ``text_config`` (Qwen2/2.5/3-VL, Qwen3.5, Gemma 3, SmolVLM,
Qwen2-Audio as transformers 5 saves them).

The shard and stage code edits a flat language config; ``NestedPart`` hands it the
language config (``Family.text``) and puts the edited one back where the model reads it
(``Family.nest``), so a stage's layer count, a shard's head counts and a middle stage's
tiny vocabulary reach the language model. The language tensors' names are the family's
own (``families.QWEN3_5_VL``: ``model.language_model.layers.N.``); the encoder's never
reach the part (``encoder_part``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tokenmill.distributed.families import Family
from tokenmill.distributed.part import ModelPart
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class NestedPart:
    """``part`` (a ``TPShard``, ``PPStage`` or ``TPStage`` over the language config) of a
    checkpoint laid out as ``family`` says."""

    part: ModelPart
    family: Family

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        assert self.family.nest is not None
        text = self.part.local_hf_config(self.family.text(hf_config))
        return self.family.nest(hf_config, text)

    def stored_types(self, types: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.part.stored_types(types)

    def adopt(self, model: nn.Module) -> None:
        self.part.adopt(model)

    def weights(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return self.part.weights(stream)

    def driver(self, local: CausalLM) -> CausalLM:
        return self.part.driver(local)

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        return self.part.handlers(model, caches)


def nested(part: ModelPart, family: Family) -> ModelPart:
    """``part`` as it loads from ``family``'s checkpoints (itself for a flat config)."""
    return part if family.nest is None else NestedPart(part, family)
