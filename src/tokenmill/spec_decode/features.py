"""Target features for speculative heads: what the target computed at each position.

An EAGLE-3 head reads the residual stream in front of a few target layers (concatenated:
[T, 3 * hidden]), an MTP head the target's final hidden states ([T, hidden]). The runner
hands every step's features to a ``FeatureTap`` (``ModelRunner.tap``), which keeps them
per request by position (``FeatureRun``) until the proposer has fed them to its head.

Positions are written in step order, so a later write at a position overwrites what a
rejected draft left there (the verify step computed features for every draft, accepted or
not); the proposer only reads positions whose tokens are known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.scheduler import ScheduledSeq

MAX_BYTES = 256 << 20
"""Most feature bytes kept per request (a long prompt's features wait for its first
proposal: 256 MiB is 5,000 positions of an 8B model's EAGLE-3 features)."""


@dataclass
class FeatureRun:
    """One request's features by position: pieces (start, [n, F]) in position order."""

    pieces: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    low: int | None = None
    """The lowest position written since the proposer last took (a rewrite below what its
    head has means the target recomputed from there: a preemption)."""

    @property
    def start(self) -> int:
        return self.pieces[0][0] if self.pieces else 0

    @property
    def end(self) -> int:
        if not self.pieces:
            return 0
        start, rows = self.pieces[-1]
        return start + rows.shape[0]

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Features of positions [start, start + n): what was at or past start is dropped;
        past ``MAX_BYTES`` the oldest pieces go (a request that drafts nothing for long:
        its head then skips those positions, which costs acceptance, not correctness)."""
        self.low = start if self.low is None else min(self.low, start)
        kept = []
        for s, t in self.pieces:
            if s >= start:
                break
            kept.append((s, t[: start - s]) if s + t.shape[0] > start else (s, t))
        if kept and kept[-1][0] + kept[-1][1].shape[0] < start:
            kept = []  # a gap: positions in between were never computed here
        kept.append((start, rows))
        size = sum(t.nelement() * t.element_size() for _, t in kept)
        while len(kept) > 1 and size > MAX_BYTES:
            size -= kept[0][1].nelement() * kept[0][1].element_size()
            kept.pop(0)
        self.pieces = kept

    def take(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions [lo, hi) (all written), concatenated; earlier ones dropped."""
        parts = [t[max(lo - s, 0) : hi - s] for s, t in self.pieces if s < hi and s + len(t) > lo]
        self.pieces = [(s, t) for s, t in self.pieces if s + len(t) > hi]
        self.low = None
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class FeatureTap:
    """Collects the target's features per step. ``layers``: capture the residual stream in
    front of these layers (EAGLE-3's auxiliary hidden states, concatenated in layer order);
    empty: the final hidden states (MTP). The model calls ``capture`` during its forward
    (``DecoderModel.aux_tap``), the runner ``record`` after it."""

    def __init__(self, layers: Sequence[int] = ()) -> None:
        self.layers = frozenset(layers)
        self._values: list[torch.Tensor] = []
        self.runs: dict[str, FeatureRun] = {}

    def capture(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if layer in self.layers:  # the stream in front of the layer; later layers write
            # into hidden/residual in place, hence a copy
            self._values.append(hidden.clone() if residual is None else hidden + residual)

    def record(
        self, seqs: Sequence[ScheduledSeq], query_start_loc: Sequence[int], hidden: torch.Tensor
    ) -> None:
        """Keep this step's features [T, F] per sequence (T rows in sequence order)."""
        if self.layers:
            if len(self._values) != len(self.layers):  # a path that captured nothing
                self._values = []
                return
            feats, self._values = torch.cat(self._values, dim=-1), []
        else:
            feats = hidden.clone()  # a fast path may hand out a buffer it reuses
        for i, s in enumerate(seqs):
            if s.request.params.disable_spec_decode:
                continue  # never drafted for: nothing would take its features
            rid = s.request.request_id
            run = self.runs.get(rid) or self.runs.setdefault(rid, FeatureRun())
            run.write(s.start, feats[query_start_loc[i] : query_start_loc[i + 1]])

    def reorder(self, request_id: str, start: int, rows: Sequence[int]) -> None:
        run = self.runs.get(request_id)
        if run is None or not run.pieces:
            return
        first, piece = run.pieces[-1]  # the tree step's rows (after a preemption's
        if not first <= start < first + len(piece):  # recompute, more known ones first)
            return
        keep = [*range(start - first), *(start - first + r for r in rows)]
        run.pieces[-1] = (first, piece[torch.tensor(keep, device=piece.device)])

    def finish(self, request_id: str) -> None:
        self.runs.pop(request_id, None)
