"""Tensor and pipeline parallelism together: one TP rank of one pipeline stage.

The rank's model is its stage's layers (``stages.PPStage``: layers cut, renumbered, the
unused table / norm / head dropped) at its TP shard's sizes (``shard.TPShard``: heads,
MLP columns and vocabulary divided, partial layers adopted as parallel ones over the
stage's TP group). Each piece is the single-kind code applied in turn, so a rank holds
only its shard of its stage's layers and reads one narrowed tensor at a time.

Running: every stage runs ``PPStage.run`` (its TP ranks cut the step into the same
micro-batches and meet in each layer's all-reduce); the last stage's TP ranks then score
the driver's ``Logits`` rows together (the vocabulary-parallel head gathers). The
driver's broadcasts go to every rank, so earlier stages receive ``Logits`` too and let it
pass: one pickled [N, hidden] per scoring call, instead of a second control group per
stage that each worker would have to listen on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tokenmill.distributed.messages import Forward, Logits
from tokenmill.distributed.shard import TPShard
from tokenmill.distributed.stages import Outbox, PPStage
from tokenmill.models.base import CausalLM


@dataclass(frozen=True)
class TPStage:
    """``shard`` (over the stage's TP group) of ``stage`` (over every rank)."""

    shard: TPShard
    stage: PPStage

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        # the stage's cut last: a middle stage's tiny vocabulary wins over the shard's
        return self.stage.local_hf_config(self.shard.local_hf_config(hf_config))

    def stored_types(self, types: Mapping[str, Any]) -> Mapping[str, Any]:
        return self.stage.stored_types(self.shard.stored_types(types))

    def adopt(self, model: nn.Module) -> None:
        self.shard.adopt(model)  # parallel layers first; the stage then drops its unused ones
        self.stage.adopt(model)

    def weights(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        # the stage's tensors only (renamed), then narrowed: the shard's rules go by leaf name
        return self.shard.weights(self.stage.weights(stream))

    def driver(self, local: CausalLM) -> CausalLM:
        from tokenmill.distributed.driver_model import TensorPipelineDriver

        return TensorPipelineDriver(local, self.stage)

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        score = model.compute_logits if self.stage.last else _pass
        outbox = Outbox()
        return {
            Forward: lambda m: self.stage.run(model, m, caches, outbox),
            Logits: lambda m: score(m.hidden),
        }


def _pass(hidden: object) -> None:
    """An earlier stage's answer to ``Logits``: the last stage's TP ranks score."""
