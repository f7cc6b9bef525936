"""What ``engine/loading.py`` and a worker need from one rank's part of a model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from torch import nn

from tokenmill.models.base import CausalLM


class ModelPart(Protocol):
    """A tensor-parallel shard (``shard.TPShard``), a pipeline stage (``stages.PPStage``)
    or a shard of a stage (``tp_stage.TPStage``)."""

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """config.json at this rank's sizes: what the model is built from."""

    def stored_types(self, types: Mapping[str, Any]) -> Mapping[str, Any]:
        """A GGUF's HF tensor name -> stored type, in this rank's names."""

    def adopt(self, model: nn.Module) -> None:
        """Adjust the built, unloaded model (parallel layers, dropped modules)."""

    def weights(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream as this rank loads it (narrowed, renamed, filtered)."""

    def driver(self, local: CausalLM) -> CausalLM:
        """Rank 0's model as its runner calls it (broadcasting each step)."""

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        """A worker's action per broadcast message type."""
