"""A rank's part of a model with a vision / audio encoder: the language model split as any
other (a ``TPShard``, ``PPStage`` or ``TPStage``), the encoder whole on the driver only.

The encoder is small next to the language model and runs once per media item, so it is
not split: the driver (rank 0) loads its tensors unnarrowed, encodes each step's media
in its runner's multimodal step, and broadcasts the embeddings with the step's inputs
(``messages.Forward.input_embeds``, with M-RoPE positions [3, T] and the bidirectional
media spans in the attention metadata); the ranks that embed (every TP rank of the first
stage) put them over the placeholder rows. Every other rank drops the encoder's modules
once built and never reads its tensors. The encoder's tensors bypass the part's rules,
which go by leaf names a tower shares with the language model (``q_proj``, ``down_proj``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tokenmill.distributed.families import Family, attr, set_attr
from tokenmill.distributed.part import ModelPart
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class EncoderPart:
    """``part`` of ``family``'s language model; ``holds``: this rank keeps the encoder."""

    part: ModelPart
    family: Family
    holds: bool

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return self.part.local_hf_config(hf_config)

    def stored_types(self, types: Mapping[str, Any]) -> Mapping[str, Any]:
        ours = {n: t for n, t in types.items() if self._encoder(n)}
        rest = self.part.stored_types({n: t for n, t in types.items() if not self._encoder(n)})
        return {**rest, **ours} if self.holds else rest

    def adopt(self, model: nn.Module) -> None:
        """The part's adoption over the language model alone (its parallel layers go by
        leaf name), then the encoder put back on the driver, dropped elsewhere."""
        encoder = {path: attr(model, path) for path in self.family.encoder_attrs}
        for path in encoder:
            set_attr(model, path, None)
        self.part.adopt(model)
        if self.holds:
            for path, module in encoder.items():
                set_attr(model, path, module)

    def weights(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Encoder tensors as they are (the driver's) or none; the rest through the part,
        one tensor at a time (the parts map each tensor alone)."""
        for name, tensor in stream:
            if not self._encoder(name):
                yield from self.part.weights(((name, tensor),))
            elif self.holds:
                yield name, tensor

    def driver(self, local: CausalLM) -> CausalLM:
        return self.part.driver(local)

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        return self.part.handlers(model, caches)

    def _encoder(self, name: str) -> bool:
        return name.startswith(self.family.encoder_prefixes)


def with_encoder_part(part: ModelPart, family: Family, rank: int) -> ModelPart:
    """``part`` of a checkpoint with an encoder (itself for a text model): rank 0 holds it."""
    return EncoderPart(part, family, rank == 0) if family.encoder_prefixes else part
