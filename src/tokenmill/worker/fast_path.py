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

from tokenmill.attention import StepContext
from tokenmill.attention.backends import AttentionBackend
from tokenmill.kv_cache.block_table import BlockTableArray
from tokenmill.models.base import CausalLM
from tokenmill.models.native_decode import NativeDecode
from tokenmill.scheduler import ScheduledSeq
from tokenmill.worker.inputs import PendingTokens, PinnedStaging, build_step_inputs


class FastPath(Protocol):
    """A way to run some steps' forward pass, chosen once when the runner is built."""

    def takes(self, seqs: tuple[ScheduledSeq, ...]) -> bool:
        """Whether this step (its scheduled sequences) runs here."""
        ...

    def run(
        self,
        seqs: tuple[ScheduledSeq, ...],
        tables: BlockTableArray | None = None,
        pending: PendingTokens | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of the step's B one-token sequences, row i = sequence i;
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

    def takes(self, seqs: tuple[ScheduledSeq, ...]) -> bool:
        return all(s.num_new_tokens == 1 for s in seqs)

    def run(
        self,
        seqs: tuple[ScheduledSeq, ...],
        tables: BlockTableArray | None = None,
        pending: PendingTokens | None = None,
    ) -> torch.Tensor:
        inputs = build_step_inputs(seqs, self.block_size, self.staging, tables, pending)
        ctx = StepContext(inputs.meta, self.kv_caches, self.backend)
        return self.decode(inputs.input_ids, inputs.positions, ctx)


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
