"""One pipeline stage of a causal model: a contiguous run of layers, built and loaded alone
(any family of ``families.FAMILIES`` or a decoder: names and layer calls per family).

Stage s of P holds layers [start_s, end_s) (an even split, earlier stages taking the
remainder), renumbered from 0 so its KV caches and names are local. Stage 0 embeds; the
last stage holds the final norm, the output head and the sampler, and is the driver
(rank 0), so the scheduler and sampler stay where they are with one device. Ranks 1..P-1
are stages 0..P-2 (with tensor parallelism too, each stage is a TP group: ``grid.Grid``).
Per step each stage receives the previous stage's (hidden, residual) [2, T, hidden]
(or the hidden [T, hidden] alone: ``Family.pairs``; stage 0: the token ids of the
broadcast, and with recurrent layers each sequence's state slot) from its peer rank, runs its layers over them
and sends the pair on, one micro-batch of rows at a time (``micro_batches``), so the
stages overlap within a step. A worker's sends of a step are waited for only when the step
after next starts (``Outbox``): with the stages overlapping across steps the driver takes
step t's pair only after it has sent step t + 1 (``executor/pipelined.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenmill.attention import StepContext
from tokenmill.distributed.families import DECODER, Carry, Family, set_attr
from tokenmill.distributed.grid import Grid
from tokenmill.distributed.group import RankGroup
from tokenmill.distributed.messages import Forward
from tokenmill.distributed.micro_batches import split_step
from tokenmill.errors import InvalidRequestError
from tokenmill.models.base import CausalLM
from tokenmill.models.config import ArchConfig

TINY_VOCAB = 16
"""Vocabulary a middle stage is built with: its unused table and head cost nothing."""


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each stage's layers; more stages than layers is a ValueError."""
    if num_stages > num_layers:
        raise InvalidRequestError(
            f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} "
            "layers; use at most one stage per layer"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (s < extra) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


Sends = list[tuple[Any, torch.Tensor]]
"""A step's pending sends: (work, the pair it sends, kept alive until taken)."""


class Outbox:
    """A worker stage's sends still on their way, one list per step.

    Step t's pieces are not waited for when step t ends: the driver may take them only
    after it has sent step t + 1 (it launches a step before it collects the one before),
    and it sends that to this stage too, so waiting here would hold both. They are waited
    for when step t + 2 starts: the driver launched t + 2 after collecting t."""

    def __init__(self) -> None:
        self._steps: deque[Sends] = deque()

    def start_step(self) -> Sends:
        """Wait for every step's sends but the latest; a list for this step's."""
        while len(self._steps) > 1:
            for work, _ in self._steps.popleft():
                work.wait()
        self._steps.append([])
        return self._steps[-1]


@dataclass(frozen=True)
class PPStage:
    """This rank's stage of ``grid`` over one architecture; ``group`` is every rank's (the
    sends and receives between stages name global ranks)."""

    cfg: ArchConfig
    group: RankGroup
    grid: Grid
    family: Family = DECODER
    """Where the family's layers, table and final norm sit, and how its layers run."""
    hf_config: dict[str, Any] | None = None
    """The checkpoint's config.json (a hybrid's per-layer types are read from it)."""

    @property
    def num_stages(self) -> int:
        return self.grid.pp

    @property
    def stage(self) -> int:
        return self.grid.stage_of(self.group.rank)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def layers(self) -> range:
        return split_layers(self.cfg.num_layers, self.num_stages)[self.stage]

    @property
    def keeps_table(self) -> bool:
        """Stage 0 embeds; a tied last stage scores with the table too."""
        return self.first or (self.last and self.cfg.tie_word_embeddings)

    def rank_of(self, stage: int) -> int:
        """The rank of ``stage`` this one exchanges activations with (same TP rank)."""
        return self.grid.peer(self.group.rank, stage)

    # -- building and loading (engine/loading.py) -----------------------------------------

    def local_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """This stage's layers only, their types spelled out (rules by index would shift)."""
        local = {**hf_config, "num_hidden_layers": len(self.layers)}
        all_types = self.family.layer_types(self.hf_config or hf_config)
        if self.family.types_key is not None and all_types is not None:
            local[self.family.types_key] = [all_types[i] for i in self.layers]
        if not (self.keeps_table or self.last):
            local["vocab_size"] = TINY_VOCAB
        return local

    def adopt(self, model: nn.Module) -> None:
        """Drop what this stage never runs (the table, the final norm, the head)."""
        if not self.keeps_table:
            set_attr(model, self.family.table_attr, None)
        if not self.last:
            for path in self.family.final_attrs:
                set_attr(model, path, None)
        model.vocab_size = self.cfg.vocab_size  # type: ignore[assignment]

    def rename(self, name: str) -> str | None:
        """A checkpoint name in this stage's numbering; None: not this stage's."""
        family = self.family
        for prefix in family.layers_names:
            if name.startswith(prefix):
                index, _, rest = name[len(prefix) :].partition(".")
                i = int(index)
                return None if i not in self.layers else f"{prefix}{i - self.layers.start}.{rest}"
        if name.startswith(family.table_names):
            return name if self.keeps_table else None
        if name.startswith(family.final_names):
            return name if self.last else None
        return name

    def stored_types(self, types: Mapping[str, Any]) -> dict[str, Any]:
        return {new: t for name, t in types.items() if (new := self.rename(name)) is not None}

    def weights(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in stream:
            if (new := self.rename(name)) is not None:
                yield new, tensor

    # -- running ---------------------------------------------------------------------------

    def driver(self, local: CausalLM) -> CausalLM:
        from tokenmill.distributed.driver_model import PipelineDriver

        return PipelineDriver(local, self)

    def handlers(self, model: CausalLM, caches: list) -> dict[type, Callable[[Any], object]]:
        outbox = Outbox()
        return {Forward: lambda m: self.run(model, m, caches, outbox)}

    def run(
        self,
        model: CausalLM,
        m: Forward,
        caches: Sequence[torch.Tensor | None],
        outbox: Outbox | None = None,
    ) -> torch.Tensor | None:
        """This stage of one step, piece by piece (``micro_batches``): the final hidden
        [T, hidden] on the last stage. Pieces go on without waiting for the next stage to
        take them; the step ends when every send has been taken, or, with an ``outbox``
        (a worker), when the step after next starts."""
        sends: Sends = [] if outbox is None else outbox.start_step()
        outs = [self._run_piece(model, piece, caches, sends)
                for piece in split_step(m, self.num_stages)]  # fmt: skip
        if outbox is None:
            for work, _ in sends:
                work.wait()
        hidden = [h for h in outs if h is not None]  # the last stage's pieces
        if not hidden:
            return None
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def _run_piece(
        self,
        model: CausalLM,
        m: Forward,
        caches: Sequence[torch.Tensor | None],
        sends: Sends,
    ) -> torch.Tensor | None:
        # media embeddings merge where the table lookup is: the first stage's
        embeds = m.input_embeds if self.first else None
        ctx = StepContext(m.attn, caches, None, m.state, m.adapter_ids, embeds)
        family, tokens = self.family, m.input_ids.shape[0]
        carry: Carry
        if self.first:
            carry = (family.embed(model, m.input_ids, ctx), None)
        else:
            carry = self._recv(model, tokens, m.input_ids.device)
        hidden, residual = family.layers(model, carry, m.positions, ctx)
        if self.last:
            return family.finish(model, (hidden, residual))
        # kept alive until its send is taken
        out = torch.stack([hidden, residual]) if residual is not None else hidden.contiguous()
        work = dist.isend(out, dst=self.rank_of(self.stage + 1), group=self.group.device)
        sends.append((work, out))
        return None

    def _recv(self, model: CausalLM, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The stage before's (hidden, residual), or its hidden alone (``Family.pairs``)."""
        family = self.family
        fp32 = family.carry_fp32(self.hf_config or {})
        dtype = torch.float32 if fp32 else model.dtype
        shape = (
            (2, tokens, self.cfg.hidden_size) if family.pairs else (tokens, self.cfg.hidden_size)
        )
        got = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(got, src=self.rank_of(self.stage - 1), group=self.group.device)
        return (got[0], got[1]) if family.pairs else (got, None)
