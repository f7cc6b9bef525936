"""The pooling runner: token ids in, one tensor per input out. No KV cache, no sampler.

Inputs are sorted by length and cut into batches whose *padded* size
(sequences x longest) stays within the token budget; each batch is packed end to
end (``PackedBatch``), so the linear layers see only real tokens and attention pads
at most to the longest of similar lengths. With int8 linears, the batch also lists the
rows that need their precise terms (``precise_rows``): every row, unless the output is a
mean over a sequence of at least ``model.int8_averaged_from`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenmill.models.bert import PackedBatch
from tokenmill.pooling.tokenize import Encoded


@dataclass(frozen=True)
class RunResult:
    """Per input, in input order: a pooled vector [D], logits [C], hidden states [L, H],
    or logits per token [L, C]."""

    tensors: list[torch.Tensor]


def plan_batches(lengths: Sequence[int], token_budget: int, max_seqs: int) -> list[list[int]]:
    """Input indices grouped into batches, longest first; padded size <= budget (a single
    input over the budget still gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and ((len(current) + 1) * longest > token_budget or len(current) >= max_seqs):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class PoolingRunner:
    """Runs a pooling model over encoded inputs (``what``: pooled, logits, tokens or
    token_logits)."""

    def __init__(
        self,
        model: Any,
        pooler: torch.nn.Module,
        device: torch.device,
        token_budget: int,
        max_seqs: int,
    ) -> None:
        self.model = model
        self.pooler = pooler
        self.device = device
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.averaged_from: int | None = getattr(model, "int8_averaged_from", None)
        """Set by ``quantize_int8``; None: no int8 linears (no precise rows)."""

    @torch.inference_mode()
    def run(self, inputs: Sequence[Encoded], what: str) -> RunResult:
        out: list[torch.Tensor | None] = [None] * len(inputs)
        lengths = [len(x.token_ids) for x in inputs]
        for group in plan_batches(lengths, self.token_budget, self.max_seqs):
            for i, tensor in zip(group, self._run_batch([inputs[i] for i in group], what)):
                out[i] = tensor
        return RunResult([t for t in out if t is not None])

    def _run_batch(self, inputs: list[Encoded], what: str) -> list[torch.Tensor]:
        batch = PackedBatch.of(len(x.token_ids) for x in inputs)
        if self.averaged_from is not None:
            batch = replace(batch, precise_rows=self._precise_rows(batch, what))
        ids = torch.tensor([t for x in inputs for t in x.token_ids], dtype=torch.int64)
        types = None
        if any(x.token_type_ids for x in inputs):
            types = torch.tensor(
                [t for x in inputs for t in (x.token_type_ids or [0] * len(x.token_ids))],
                dtype=torch.int64,
            )
        if self.device.type != "cpu":
            ids = ids.to(self.device)
            types = types.to(self.device) if types is not None else None
            batch = _to(batch, self.device)
        hidden = self.model(ids, batch, types)  # [T, H]
        if what in ("tokens", "token_logits"):
            if what == "token_logits":
                hidden = self.model.classify(hidden, batch)  # [T, C]
            return [h.float().cpu() for h in hidden.split(list(batch.seq_lens))]
        result = (
            self.model.classify(hidden, batch) if what == "logits" else self.pooler(hidden, batch)
        )
        return list(result.float().cpu().unbind(0))  # the one device-to-host point

    def _precise_rows(self, batch: PackedBatch, what: str) -> torch.Tensor | None:
        """[R] rows for the int8 precise terms: those of mean-pooled sequences shorter than
        ``averaged_from``; every row for any other output (one token's vector, or logits,
        carry one row's rounding whole). Depends on each sequence alone, so batching
        leaves a sequence's numbers unchanged."""
        total = sum(batch.seq_lens)
        if what != "pooled" or self.pooler.config.pooling_type != "MEAN":
            return torch.arange(total)
        short = batch.lens < (self.averaged_from or 0)
        if not bool(short.any()):
            return None
        return torch.repeat_interleave(short, batch.lens).nonzero().flatten()


def _to(batch: PackedBatch, device: torch.device) -> PackedBatch:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to(device) if t is not None else None

    return PackedBatch(
        batch.seq_lens,
        batch.starts.to(device),
        batch.lens.to(device),
        move(batch.pad_index),
        move(batch.key_mask),
        move(batch.precise_rows),
    )
