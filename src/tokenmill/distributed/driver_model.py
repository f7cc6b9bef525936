"""The model as the driver's runner sees it: rank 0's tensor-parallel shard, the last
pipeline stage, or TP rank 0 of the last stage (with a media encoder: the whole encoder).

``ModelRunner`` calls ``forward`` and ``compute_logits`` as on one device; each call here
first broadcasts what the workers need to make the same call on their shards (their
collectives meet this rank's inside the layers), then runs rank 0's shard. Everything
else (cache specs, sizes, ops) is rank 0's local model's: every rank's KV cache has the
same blocks, each holding that rank's KV heads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from tokenmill.attention import StepContext
from tokenmill.distributed.group import RankGroup
from tokenmill.distributed.messages import Forward, Logits, RollBack, forward_of
from tokenmill.kv_cache.snapshots import StateStep
from tokenmill.kv_cache.spec import CacheSpec
from tokenmill.models.base import CausalLM
from tokenmill.multimodal.inputs import MediaItem
from tokenmill.multimodal.model import SupportsMultiModal, multimodal_info
from tokenmill.worker.state_rollback import RollbackCopies

if TYPE_CHECKING:
    from tokenmill.distributed.stages import PPStage


class _Driver(CausalLM):
    """Rank 0's local model with the runner's interface."""

    def __init__(self, local: CausalLM, group: RankGroup) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.num_layers, self.num_kv_heads = local.num_layers, local.num_kv_heads
        self.head_dim, self.vocab_size = local.head_dim, local.vocab_size
        self.dtype, self.ops = local.dtype, local.ops
        self._snapshot: StateStep | None = None
        info = multimodal_info(local)
        if info is not None:  # the encoder is the driver's (``encoder_part``)
            self.multimodal = info

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Media items -> their placeholder embeddings, on this rank's whole encoder (the
        runner's multimodal step puts them in the step context, which ``forward``
        broadcasts)."""
        local = self.local
        assert isinstance(local, SupportsMultiModal), "a text model has nothing to encode"
        return local.encode(items)

    def recording(
        self, state_step: Callable[[list[str]], StateStep]
    ) -> Callable[[list[str]], StateStep]:
        """``state_step`` (the coordinator's, which the runner calls just before each
        forward) that also keeps its answer for the forward's broadcast: the workers make
        the same snapshot copies on their own caches."""

        def recorded(request_ids: list[str]) -> StateStep:
            self._snapshot = state_step(request_ids)
            return self._snapshot

        return recorded

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> Forward:
        snapshot, self._snapshot = self._snapshot, None
        return forward_of(input_ids, positions, ctx, snapshot)

    def rolled_back(self, copies: RollbackCopies) -> None:
        """A verify step's rollback copies (the runner made them on this rank's slots):
        the workers make them on theirs (``worker.StepRollback``)."""
        self.group.broadcast(RollBack(copies))

    def cache_specs(self) -> list[CacheSpec]:
        return self.local.cache_specs()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise TypeError("a distributed model loads on each rank (distributed/shard.py)")


class TensorParallelDriver(_Driver):
    """Each call broadcast first: the workers make it on their shards."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        self.group.broadcast(self._step(input_ids, positions, ctx))
        return self.local(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(Logits(hidden.cpu()))
        return self.local.compute_logits(hidden)


class PipelineDriver(_Driver):
    """The last stage: the step's inputs go to every stage, its layers run on what the
    stage before sends; the head and the sampler are local (no logits leave the rank).

    Between the two sits ``park``: the pipelined executor (``executor/pipelined.py``) holds
    a step there while it sends the next step's inputs, so stage 0 runs step t + 1 while
    this rank runs step t's layers and samples it. ``events`` records each step's two
    moments in order, ("sent", n) and ("ran", n): the overlap, as a test sees it."""

    def __init__(self, local: CausalLM, stage: PPStage) -> None:
        super().__init__(local, stage.group)
        self.stage = stage
        self.park: Callable[[], None] | None = None
        self.events: deque[tuple[str, int]] = deque(maxlen=256)
        self._steps = 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        self.group.broadcast(self._step(input_ids, positions, ctx))
        # this rank's step on its own device, with its own snapshot rows
        step = Forward(input_ids, positions, ctx.attn, ctx.adapter_ids, ctx.input_embeds, ctx.state)
        n = self._steps = self._steps + 1
        self.events.append(("sent", n))
        if self.park is not None:
            self.park()
        hidden = self.stage.run(self.local, step, ctx.kv_caches)
        assert hidden is not None
        self.events.append(("ran", n))
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.compute_logits(hidden)


class TensorPipelineDriver(PipelineDriver):
    """TP rank 0 of the last stage: the stages run as in ``PipelineDriver``; the rows to
    score are broadcast first, so the stage's other TP ranks join the vocabulary-parallel
    head's gather (the earlier stages let the message pass: ``tp_stage``)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(Logits(hidden.cpu()))
        return self.local.compute_logits(hidden)
