"""Fast paths: whole steps the runner hands to something faster than the eager forward.

One protocol for both: the CUDA-graph replay of all-decode steps (``cuda_graphs.
PaddedDecode``) and the CPU whole-layer decode of quantized pre-norm models
(``NativeDecodePath`` over ``models/native_decode.py``). The runner owns at most one and
asks it for every step (``takes``); a step it does not take runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.attention import AttentionMetadata, StepContext
from tokenmill.attention.backends import AttentionBackend
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.models.base import CausalLM
from tokenmill.models.native_decode import NativeDecode
from tokenmill.worker.inputs import (
    PendingTokens,
    PinnedStaging,
    StepColumns,
    StepLike,
    build_step_inputs,
)


class FastPath(Protocol):
    """A way to run some steps' forward pass, chosen once when the runner is built."""

    def takes(self, step: StepLike, cols: StepColumns | None = None) -> bool:
        """Whether this step (as scheduled, or its sequences' records; ``cols``: the same
        as columns, made once per step by the runner) runs here."""
        ...

    def run(
        self,
        step: StepLike,
        tables: BlockTableArray | None = None,
        pending: PendingTokens | None = None,
        cols: StepColumns | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens, flattened in sequence order (T = B
        for one-token sequences: row i = sequence i);
        ``tables``: the scheduler's block-table array (None: the sequences' lists);
        ``pending``: input tokens still on the device (asynchronous scheduling)."""
        ...


class NativeDecodePath:
    """All-decode steps of a model ``NativeDecode`` runs (CPU, float32, native kernels)."""

    def __init__(
        self,
        decode: NativeDecode,
        kv_caches: Sequence[torch.Tensor | None],
        block_size: int,
        device: torch.device,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.decode = decode
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.staging = PinnedStaging(device)
        self.short_chunks = 0
        """Also take steps whose sequences all have at most this many new tokens (0: none).
        A draft model's runner sets it for its catch-up steps (the tokens the target
        accepted since the last proposal): the rows' attention is the native decode
        kernel's, not the prefill path's, which only a draft may take (its numbers move
        acceptance, never the output)."""

    def takes(self, step: StepLike, cols: StepColumns | None = None) -> bool:
        """Decode steps, also verifying drafts: each sequence's new tokens are its last
        known token and its drafts (or any few, ``short_chunks``)."""
        cols = cols or StepColumns.of(step, self.block_size)
        if cols.one_token_each:
            return True
        c = cols.seq
        if self.short_chunks and max(c.num_new) <= self.short_chunks:
            return True
        drafts = c.drafts
        return all(n == 1 + len(drafts.get(i, ())) for i, n in enumerate(c.num_new))

    def run(
        self,
        step: StepLike,
        tables: BlockTableArray | None = None,
        pending: PendingTokens | None = None,
        cols: StepColumns | None = None,
    ) -> torch.Tensor:
        inputs = build_step_inputs(step, self.block_size, self.staging, tables, pending, cols)
        meta = inputs.meta
        if not meta.is_all_decode:
            meta = per_token_rows(meta, inputs.positions)
        ctx = StepContext(meta, self.kv_caches, self.backend)
        return self.decode(inputs.input_ids, inputs.positions, ctx)


def per_token_rows(meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
    """A verify step (sequences of several new tokens) seen as one decode row per token:
    token t of a sequence attends to its sequence's blocks up to its own position, so
    each row takes its sequence's block table and ``position + 1`` as its length. The
    layer stores every token's K/V before any attention reads, so the rows see the drafts
    before them, as causal attention over the chunk would."""
    qsl = meta.query_start_loc
    counts = torch.tensor([b - a for a, b in zip(qsl, qsl[1:])])
    lens = positions + 1
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        query_start_loc=tuple(range(len(positions) + 1)),
        seq_lens=tuple(lens.tolist()),
        block_tables=meta.block_tables.repeat_interleave(counts, dim=0),
        block_size=meta.block_size,
        seq_lens_tensor=lens,
    )


def cpu_fast_path(
    model: CausalLM,
    kv_caches: Sequence[torch.Tensor | None],
    block_size: int,
    device: torch.device,
) -> NativeDecodePath | None:
    """The whole-layer CPU decode when ``model`` can run it (its layers were built for the
    native backend, ``layers/ops.py``), else None."""
    if device.type != "cpu":
        return None
    decode = NativeDecode.build(model)
    return None if decode is None else NativeDecodePath(decode, kv_caches, block_size, device)
