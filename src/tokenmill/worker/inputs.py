"""Host <-> device traffic of one step: one packed copy of the integer inputs up, the
sampled ids down.

On CUDA both directions go through pinned host buffers: the input copy is queued with
``non_blocking`` (the host goes on while it runs) and the step's one wait is the
synchronize after the sampled ids are queued back. On CPU the same calls build plain
tensors, exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata
from tokenmill.attention.metadata import first_if_contiguous
from tokenmill.scheduler import ScheduledSeq


class PinnedStaging:
    """A reusable int64 host buffer (pinned on CUDA) for one host-to-device copy at a time.

    Before the buffer is rewritten, the event of its previous copy is waited on, so a copy
    still in flight (say from a step that raised) never reads half-new values.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._done: torch.cuda.Event | None = None

    def upload(self, values: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """values -> int64 [len(values)] on the device; into ``out`` (same length) if given."""
        if not self.pinned:
            host = torch.tensor(values, dtype=torch.int64)
            return host if out is None else out.copy_(host)
        n = len(values)
        if self._done is not None:
            self._done.synchronize()
        if n > self._host.numel():
            size = max(n, 2 * self._host.numel(), 4096)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=True)
        self._host.numpy()[:n] = values
        if out is None:
            out = torch.empty(n, dtype=torch.int64, device=self.device)
        out.copy_(self._host[:n], non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return out


class HostIds:
    """The step's device-to-host point: sampled ids [N] int64 -> list[int].

    On CUDA the copy goes into a pinned buffer with ``non_blocking`` and one stream
    synchronize waits for it (and for everything queued before: the whole step).
    """

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)

    def fetch(self, ids: torch.Tensor) -> list[int]:
        if not self.pinned:
            return ids.tolist()
        n = ids.numel()
        if n > self._host.numel():
            self._host = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        host = self._host[:n]
        host.copy_(ids, non_blocking=True)
        torch.cuda.current_stream(ids.device).synchronize()
        return host.tolist()


@dataclass(frozen=True)
class StepInputs:
    """A flattened batch on the device: T new tokens of B sequences."""

    input_ids: torch.Tensor
    """[T] int64."""
    positions: torch.Tensor
    """[T] int64."""
    meta: AttentionMetadata


def build_step_inputs(
    seqs: tuple[ScheduledSeq, ...], block_size: int, staging: PinnedStaging
) -> StepInputs:
    """Flatten the scheduled tokens; every integer tensor of the step comes from one copy of
    the packed host vector [ids T | positions T | slots T | seq_lens B | qsl B+1 | tables B*W]
    (block tables padded with 0 to the longest, W >= 1)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    for s in seqs:
        ids.extend(s.request.all_token_ids[s.start : s.end])
        pos.extend(range(s.start, s.end))
        table = s.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos[qsl[-1] :])
        qsl.append(qsl[-1] + s.num_new_tokens)
    seq_lens = [s.end for s in seqs]
    width = max((len(s.block_table) for s in seqs), default=1) or 1
    tables: list[int] = []
    for s in seqs:
        tables.extend(s.block_table)
        tables.extend([0] * (width - len(s.block_table)))
    packed = staging.upload(ids + pos + slots + seq_lens + qsl + tables)
    t, b = len(ids), len(seqs)
    ids_d, pos_d, slots_d, lens_d, qsl_d, tables_d = packed.split([t, t, t, b, b + 1, b * width])
    meta = AttentionMetadata(
        slot_mapping=slots_d,
        query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens),
        block_tables=tables_d.view(b, width),
        block_size=block_size,
        seq_lens_tensor=lens_d,
        first_block_if_contiguous=tuple(
            first_if_contiguous(s.block_table, -(-s.end // block_size)) for s in seqs
        ),
        query_start_loc_tensor=qsl_d,  # a view of the packed copy: no extra op
    )
    return StepInputs(ids_d, pos_d, meta)
