"""The runner's multimodal part of a step: encoder outputs over placeholder rows, M-RoPE.

For each scheduled sequence of a request with media, the items whose placeholder runs
intersect the step's tokens [start, end) are encoded (one tower call for every item the
cache misses), and the rows of the intersection go into ``StepContext.input_embeds``: a
chunk boundary inside a run takes only that chunk's rows. A text-only step costs one
attribute test per sequence, and a text-only model has no ``MultiModalStep`` at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from tokenmill.attention.context import InputEmbeds, StepContext
from tokenmill.multimodal.encoder_cache import EncoderCache, EncoderStats
from tokenmill.multimodal.inputs import MediaItem, MultiModalInputs
from tokenmill.multimodal.model import SupportsMultiModal, multimodal_info
from tokenmill.scheduler.output import ScheduledSeq


class MultiModalStep:
    def __init__(self, model: SupportsMultiModal, cache_bytes: int) -> None:
        self.model = model
        self.info = model.multimodal
        self.cache = EncoderCache(cache_bytes)
        self.stats = EncoderStats()

    def prepare(
        self, seqs: Sequence[ScheduledSeq], ctx: StepContext, positions: torch.Tensor
    ) -> tuple[torch.Tensor, StepContext]:
        """(positions [T] or [3, T], the context with the embeddings to merge and, for
        bidirectional media, the spans attention widens) of one step."""
        work = [(i, s, s.request.mm_inputs) for i, s in enumerate(seqs)
                if s.request.mm_inputs is not None]  # fmt: skip
        if not work:
            return positions, ctx
        qsl = ctx.attn.query_start_loc
        positions, embeds = self._positions_and_embeds(work, qsl, positions)
        spans = _bidirectional_spans(len(seqs), work)
        attn = ctx.attn if spans is None else replace(ctx.attn, bidirectional_spans=spans)
        return positions, replace(ctx, attn=attn, input_embeds=embeds)

    def _positions_and_embeds(
        self,
        work: list[tuple[int, ScheduledSeq, MultiModalInputs]],
        qsl: Sequence[int],
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, InputEmbeds | None]:
        if self.info.uses_mrope:
            positions = positions.expand(3, -1).clone()
            for i, s, mm in work:
                positions[:, qsl[i] : qsl[i + 1]] = mm.positions(s.start, s.end).to(
                    positions.device
                )
        rows, values = self._embeddings(work, qsl)
        if not rows:
            return positions, None
        row_t = torch.cat(rows).to(positions.device)
        embeds = InputEmbeds(row_t, torch.cat(values))
        layers = self.info.deepstack_layers
        if layers:  # [N, (1 + L) * hidden] -> the embedding and L DeepStack rows
            n = embeds.values.shape[0]
            stacked = embeds.values.view(n, 1 + layers, -1)
            embeds = InputEmbeds(row_t, stacked[:, 0], stacked[:, 1:])
        return positions, embeds

    def _embeddings(
        self, work: list[tuple[int, ScheduledSeq, MultiModalInputs]], qsl: Sequence[int]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        needed: list[tuple[int, ScheduledSeq, MultiModalInputs, int]] = []
        for i, s, mm in work:
            for j in mm.overlapping(s.start, s.end):
                needed.append((i, s, mm, j))
        if not needed:
            return [], []
        embeds, encoded = self._encode_missing([mm.items[j] for _, _, mm, j in needed])
        rows, values = [], []
        for i, s, mm, j in needed:
            r = mm.ranges[j]
            a, b = max(r.offset, s.start), min(r.end, s.end)  # the chunk's part of the run
            if a == r.offset or s.start == s.request.num_cached_tokens:  # its first chunk
                self.stats.items += 1
                self.stats.cache_hits += mm.items[j].content_hash not in encoded
            rows.append(torch.arange(a - s.start, b - s.start) + qsl[i])
            values.append(embeds[mm.items[j].content_hash][a - r.offset : b - r.offset])
        return rows, values

    def _encode_missing(
        self, items: list[MediaItem]
    ) -> tuple[dict[bytes, torch.Tensor], set[bytes]]:
        """(embeddings by hash, the hashes encoded now): one tower call for the misses."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, MediaItem] = {}
        for it in items:
            hit = self.cache.get(it.content_hash)
            if hit is not None:
                found[it.content_hash] = hit
            else:
                missing.setdefault(it.content_hash, it)
        if missing:
            t0 = time.perf_counter()
            outs = self.model.encode(list(missing.values()))
            self.stats.encoder_seconds += time.perf_counter() - t0
            self.stats.encoder_runs += len(missing)
            for key, out in zip(missing, outs):
                found[key] = out
                self.cache.put(key, out, self.stats)
        return found, set(missing)


def _bidirectional_spans(
    num_seqs: int, work: list[tuple[int, ScheduledSeq, MultiModalInputs]]
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per sequence, the bidirectional runs its chunk holds two or more tokens of (one
    token sees the whole run's past anyway); None when no sequence has one."""
    found: dict[int, tuple[tuple[int, int], ...]] = {}
    for i, s, mm in work:
        if mm.bidirectional:
            ranges = [mm.ranges[j] for j in mm.overlapping(s.start, s.end)]
            runs = tuple((r.offset, r.end) for r in ranges
                         if min(r.end, s.end) - max(r.offset, s.start) > 1)  # fmt: skip
            if runs:
                found[i] = runs
    if not found:
        return None
    return tuple(found.get(i, ()) for i in range(num_seqs))


def multimodal_step(model: object, cache_bytes: int) -> MultiModalStep | None:
    """The runner's multimodal step for a model with an encoder, else None."""
    if multimodal_info(model) is None or not isinstance(model, SupportsMultiModal):
        return None
    return MultiModalStep(model, cache_bytes)
