"""Drafts from a speculative head (EAGLE-3, MTP) that reads the target's own features.

The head's one attention layer keeps its KV in the target's paged blocks (a tensor of
its own, indexed by the target's block tables and slots), so a prefix-cache hit of the
target is one of the head too. Head position i holds (token t[i+1], feature of target
position i). Each proposal, per request with m known tokens:

1. catch-up: head positions [computed, m - 1) from the features the target computed there
   (``features.FeatureTap``; overwriting what its drafts left): the last row drafts d1;
2. k - 1 one-token steps: position m - 2 + j takes d_j and the head's own output at the
   position before; they write provisional KV at m - 1 .. m + k - 3 (rewritten by the
   next catch-up, which restarts at m' - 1 >= m - 1).

Drafts are greedy (a point mass: the target's exact-match verification keeps its own
distribution whatever they are).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.attention import StepContext
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_cache.spec import allocate_caches
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ScheduledSeq
from tokenmill.scheduler.draft_tree import DraftTree
from tokenmill.scheduler.request import Request
from tokenmill.spec_decode.adaptive import CostCurve
from tokenmill.spec_decode.features import FeatureTap
from tokenmill.spec_decode.proposer import TreeShape
from tokenmill.worker.inputs import PinnedStaging, build_step_inputs

if TYPE_CHECKING:
    from tokenmill.spec_decode.config import SpeculativeConfig
    from tokenmill.spec_decode.heads import SpecHead
    from tokenmill.spec_decode.registry import TargetParts

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class HeadSeq:
    """The head's view of one request."""

    shifted: Request
    """Its tokens from the second on (head position i takes token i + 1), then the drafts
    of the proposal being made."""
    computed: int
    """Leading head positions whose KV came from target features."""


@dataclass
class _Chunk:
    seq: HeadSeq
    start: int
    num: int
    features: torch.Tensor  # [num, F]


class HeadProposer:
    """``Proposer`` of a ``SpecHead``'s drafts (vLLM's methods ``eagle3`` and ``mtp``)."""

    costly = True

    def __init__(
        self, head: SpecHead, target: TargetParts, cache: torch.Tensor, max_model_len: int
    ) -> None:
        if not isinstance(target.kv, KVCacheManager):
            raise InvalidRequestError(
                f"speculative decoding ({head.name}) needs an attention-only target"
            )
        self.head = head
        self.name = head.name
        self.kv = target.kv
        self.runner = target.runner
        self.cache = cache
        self.block_size = target.kv.block_size
        self.vocab_size = target.loaded.model.vocab_size
        self.max_model_len = max_model_len
        self.tap = FeatureTap(head.feature_layers)
        self.staging = PinnedStaging(cache.device)
        self._seqs: dict[str, HeadSeq] = {}

    @classmethod
    def build(cls, head: SpecHead, target: TargetParts) -> HeadProposer:
        spec = head.cache_spec()
        cache = allocate_caches([spec], target.kv.num_blocks, target.kv.block_size, 1,
                                target.loaded.device)[0]  # fmt: skip
        assert cache is not None
        return cls(head, target, cache, target.loaded.max_model_len)

    def attach(self) -> None:
        """Start receiving the target's features (after start-up measurements)."""
        self.runner.tap = self.tap
        if self.head.feature_layers:
            model = self.runner.model
            assert isinstance(model, DecoderForCausalLM)  # (load_head checked)
            model.model.aux_tap = self.tap
            if self.runner.decode is not None and self.runner.device.type == "cuda":
                logger.warning(
                    "speculative decoding (%s): CUDA graphs do not capture the target's "
                    "auxiliary hidden states; decode steps run eagerly", self.name,
                )  # fmt: skip
                self.runner.decode = None

    # -- Proposer -------------------------------------------------------------------------
    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        drafts: dict[str, list[int]] = {req.request_id: [] for req in requests}
        self._run(requests, k, drafts)
        return [drafts[req.request_id] for req in requests]

    def _run(
        self,
        requests: Sequence[Request],
        k: int,
        drafts: dict[str, list[int]],
        top: tuple[int, dict[str, list[tuple[list[int], list[float]]]]] | None = None,
    ) -> None:
        """Catch up and draft every request that has room (``_draft``)."""
        chunks = [c for c in (self._catch_up(req, k) for req in requests) if c is not None]
        if chunks:
            self._draft(chunks, k, drafts, top)

    def finish(self, request: Request) -> None:
        self._seqs.pop(request.request_id, None)
        self.tap.finish(request.request_id)

    # -- steps ----------------------------------------------------------------------------
    def _catch_up(self, req: Request, k: int) -> _Chunk | None:
        """The head positions this request's features allow now; None: none (or no room)."""
        rid, tokens = req.request_id, req.all_token_ids
        run = self.tap.runs.get(rid)
        if run is None:
            return None
        seq = self._seqs.get(rid)
        if seq is None:
            shifted = Request(rid, list(tokens[1:]), _GREEDY, 1 << 30, frozenset())
            seq = self._seqs[rid] = HeadSeq(shifted, req.num_cached_tokens)
        if run.low is not None and run.low < seq.computed:  # recomputed (preempted)
            seq.computed = run.low
        # Positions before the features (a prefix-cache hit) keep the head KV found there.
        seq.computed = max(seq.computed, run.start)
        known = seq.shifted.all_token_ids
        known.extend(tokens[1 + len(known) :])
        end = len(tokens) - 1  # head positions [0, m - 1) take known tokens and features
        if seq.computed >= end or run.end < end:
            return None
        if len(tokens) + k > self.max_model_len or not self.kv.allocate_slots(rid, end + k - 1):
            return None
        start = seq.computed
        return _Chunk(seq, start, end - start, run.take(start, end))

    def propose_tree(
        self, requests: Sequence[Request], k: int, shape: TreeShape
    ) -> list[DraftTree]:
        """Per request, its draft chain (the head's greedy path, as ``propose``) with the
        head's next ``shape.top_k - 1`` guesses at each depth as leaves beside it, the best
        ``shape.nodes`` nodes by the head's path probability."""
        drafts: dict[str, list[int]] = {req.request_id: [] for req in requests}
        guesses: dict[str, list[tuple[list[int], list[float]]]] = {
            req.request_id: [] for req in requests
        }
        self._run(requests, k, drafts, (shape.top_k, guesses))
        return [caterpillar(guesses[r.request_id], shape.nodes, self.vocab_size) for r in requests]

    def _draft(
        self,
        chunks: list[_Chunk],
        k: int,
        drafts: dict[str, list[int]],
        top: tuple[int, dict[str, list[tuple[list[int], list[float]]]]] | None = None,
    ) -> None:
        """The catch-up step, then k - 1 one-token steps, for all ``chunks`` at once;
        ``top`` = (k', out): also keep each step's k' best guesses and their logprobs."""
        for c in chunks:
            c.seq.computed = c.start + c.num
        live = chunks
        for step in range(k):
            hidden, feats = self._step(live)
            if top is None:
                ids = self.head.draft_ids(hidden).tolist()
            else:
                top_ids, top_lp = self.head.draft_topk(hidden, top[0])
                ids = top_ids[:, 0].tolist()
                for c, row_ids, row_lp in zip(live, top_ids.tolist(), top_lp.tolist()):
                    top[1][c.seq.shifted.request_id].append((row_ids, row_lp))
            going = []
            for c, token, feat in zip(live, ids, feats):
                if token >= self.vocab_size:
                    continue  # an id the target does not have: this draft ends here
                drafts[c.seq.shifted.request_id].append(token)
                if step < k - 1:
                    c.seq.shifted.all_token_ids.append(token)
                    going.append(_Chunk(c.seq, c.start + c.num, 1, feat[None]))
            live = going
            if not live:
                break
        for c in chunks:  # back to the known tokens
            del c.seq.shifted.all_token_ids[c.seq.computed :]

    def _step(self, chunks: list[_Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass -> (hidden, next feature) at each chunk's last position [B, H]."""
        scheduled = []
        for c in chunks:
            table, row = self.kv.table_and_row(c.seq.shifted.request_id)
            scheduled.append(ScheduledSeq(c.seq.shifted, c.start, c.num, table, True, row))
        inputs = build_step_inputs(tuple(scheduled), self.block_size, self.staging, self.kv.tables)
        features = chunks[0].features if len(chunks) == 1 else torch.cat(
            [c.features for c in chunks]
        )  # fmt: skip
        ctx = StepContext(inputs.meta, [self.cache])
        with torch.inference_mode():
            hidden, feats = self.head(inputs.input_ids, inputs.positions, ctx, features)
        qsl = inputs.meta.query_start_loc
        if len(qsl) - 1 == hidden.shape[0]:
            return hidden, feats
        last = torch.tensor([q - 1 for q in qsl[1:]], device=hidden.device)
        return hidden.index_select(0, last), feats.index_select(0, last)

    # -- start-up ---------------------------------------------------------------------------
    def measure_step_cost(self, max_seqs: int) -> CostCurve:
        """Seconds of one one-token head step by batch size (scratch blocks, freed after)."""
        points: dict[int, float] = {}
        width = self._feature_width()
        batch = 1
        while batch <= min(max_seqs, 64):
            took = self._scratch_step(batch, width)
            if took is None:
                break
            points[batch] = took
            batch *= 2
        return CostCurve.from_points(points) if points else CostCurve.linear()

    def _feature_width(self) -> int:
        return int(self.head.config.hidden_size)

    def _scratch_step(self, batch: int, width: int) -> float | None:
        ids = [f"__head_calibrate_{i}" for i in range(batch)]
        try:
            chunks = []
            for rid in ids:
                if not self.kv.allocate_slots(rid, 64):
                    return None
                seq = HeadSeq(Request(rid, [0] * 64, _GREEDY, 1, frozenset()), 63)
                feats = torch.zeros(1, width, dtype=self.cache.dtype, device=self.cache.device)
                chunks.append(_Chunk(seq, 63, 1, feats))
            best = None
            for _ in range(3):
                start = time.perf_counter()
                hidden, _ = self._step(chunks)
                self.head.draft_ids(hidden).tolist()
                took = time.perf_counter() - start
                best = took if best is None else min(best, took)
            return best
        finally:
            for rid in ids:
                self.kv.free(rid)


def build_head_proposer(spec: SpeculativeConfig, target: TargetParts) -> HeadProposer:
    """The method's head loaded beside the target (a ValueError for a target it can not
    read features of, or a checkpoint without the head)."""
    from tokenmill.spec_decode.heads.loading import load_head

    head = load_head(spec, target)
    return HeadProposer.build(head, target)


def caterpillar(
    steps: Sequence[tuple[list[int], list[float]]], nodes: int, vocab_size: int
) -> DraftTree:
    """A draft tree from the guesses of each draft step, best first: the chain of first
    guesses, and each later guess as a leaf beside the chain node of its depth; the
    ``nodes`` nodes of highest path logprob (a node never scores above its parent, so the
    chosen ones form a tree), ordered by depth (parents first)."""
    scored: list[
        tuple[float, int, int, int, int]
    ] = []  # (-logprob, depth, rank, token, parent depth)
    path = 0.0
    for depth, (ids, lps) in enumerate(steps, 1):
        if ids[0] >= vocab_size:
            break
        for rank, (token, lp) in enumerate(zip(ids, lps)):
            if token < vocab_size:
                scored.append((-(path + lp), depth, rank, token, depth - 1))
        path += lps[0]
    chosen = sorted(sorted(scored)[:nodes], key=lambda x: (x[1], x[2]))
    tokens: list[int] = []
    parents: list[int] = []
    chain_at = {0: -1}  # depth -> index of the chain node there (0: the root)
    for _, depth, rank, token, parent_depth in chosen:
        if parent_depth not in chain_at:
            continue  # its chain parent was not chosen (ties)
        parents.append(chain_at[parent_depth])
        tokens.append(token)
        if rank == 0:
            chain_at[depth] = len(tokens) - 1
    return DraftTree(tuple(tokens), tuple(parents))
