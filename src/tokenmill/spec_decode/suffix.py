"""Suffix decoding: drafts from what followed the current context, in this request and in
earlier ones (agentic loops and repeated outputs say the same things again).

Two context indexes map a context (the last L tokens, L in ``CONTEXT_LENGTHS`` up to the
tree depth) to counts of the token that followed it: one per running request over its
prompt and output, one shared over the outputs of the latest finished requests (at most
``max_cached_requests``: the oldest is subtracted out, so memory stays bounded). A draft
starts at the longest matching context of either index and follows the most frequent
continuation while the product of their frequencies (the estimated chance that the whole
draft is right) stays at or above ``min_token_prob``; its length is capped by
``max_spec_factor`` times the matched length, so a short match drafts little.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.scheduler.draft_tree import DraftTree
from tokenmill.scheduler.request import Request
from tokenmill.spec_decode.proposer import TreeShape

CONTEXT_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Context lengths indexed (a geometric ladder: ~8 inserts per token, not depth many)."""


@dataclass
class ContextCounts:
    """context tuple -> {next token: count}, over one or more token sequences."""

    lengths: tuple[int, ...]
    counts: dict[tuple[int, ...], dict[int, int]] = field(default_factory=dict)

    def add(self, tokens: Sequence[int], start: int = 1, sign: int = 1) -> None:
        """Count (sign=-1: uncount) each token at positions >= start after its contexts."""
        for pos in range(max(start, 1), len(tokens)):
            nxt = tokens[pos]
            for n in self.lengths:
                if n > pos:
                    break
                key = tuple(tokens[pos - n : pos])
                follow = self.counts.get(key)
                if follow is None:
                    if sign < 0:
                        continue
                    follow = self.counts[key] = {}
                left = follow.get(nxt, 0) + sign
                if left > 0:
                    follow[nxt] = left
                else:
                    follow.pop(nxt, None)
                    if not follow:
                        del self.counts[key]

    def longest(self, tokens: Sequence[int]) -> int:
        """Length of the longest indexed context that ends ``tokens`` (0: none)."""
        best = 0
        for n in self.lengths:
            if n > len(tokens) or tuple(tokens[len(tokens) - n :]) not in self.counts:
                break  # a longer context can only be indexed if this one is
            best = n
        return best

    def next(self, tokens: Sequence[int], n: int) -> tuple[int, float] | None:
        """(most frequent successor, its frequency) after the last n tokens."""
        follow = self.counts.get(tuple(tokens[len(tokens) - n :]))
        if not follow:
            return None
        token = max(follow, key=follow.__getitem__)
        return token, follow[token] / sum(follow.values())


class SuffixProposer:
    """``Proposer`` of suffix-decoding drafts (vLLM's method ``suffix``)."""

    name = "suffix"
    costly = False

    def __init__(
        self,
        max_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        self.lengths = tuple(n for n in CONTEXT_LENGTHS if n <= max_depth)
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.shared = ContextCounts(self.lengths)
        self._cached: deque[tuple[list[int], int]] = deque()
        """The shared index's sequences (tokens, first counted position), oldest first."""
        self._own: dict[str, tuple[ContextCounts, list[int]]] = {}
        """request id -> (its index, [tokens indexed])."""

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        return [self._propose_one(req, k) for req in requests]

    def _match(self, req: Request, k: int) -> tuple[ContextCounts, int, list[int]] | None:
        """(the index with the longest context ending the request, the draft length that
        match allows, the request's last tokens as context); None: no match."""
        own = self._own_index(req)
        tokens = req.all_token_ids
        matched_own, matched_shared = own.longest(tokens), self.shared.longest(tokens)
        matched = max(matched_own, matched_shared)
        if not matched:
            return None
        index = own if matched_own >= matched_shared else self.shared
        limit = min(k, max(1, int(self.max_spec_factor * matched)))
        return index, limit, list(tokens[len(tokens) - max(self.lengths) :])

    def _propose_one(self, req: Request, k: int) -> list[int]:
        match = self._match(req, k)
        if match is None:
            return []
        index, limit, context = match
        drafts: list[int] = []
        chance = 1.0
        while len(drafts) < limit:
            n = index.longest(context)
            step = index.next(context, n) if n else None
            if step is None:
                break
            token, freq = step
            chance *= freq
            if chance < self.min_token_prob:
                break
            drafts.append(token)
            context.append(token)
        return drafts

    def propose_tree(
        self, requests: Sequence[Request], k: int, shape: TreeShape
    ) -> list[DraftTree]:
        """Per request, the continuations of its context as a tree: best first by the
        estimated chance of the path (the product of frequencies), each node's
        ``shape.top_k`` most frequent successors, at most ``shape.nodes`` nodes, no deeper
        than k (nor than ``max_spec_factor`` x the matched length)."""
        return [self._tree_one(req, k, shape) for req in requests]

    def _tree_one(self, req: Request, k: int, shape: TreeShape) -> DraftTree:
        match = self._match(req, k)
        if match is None:
            return DraftTree((), ())
        index, limit, base = match
        out: list[int] = []
        parents: list[int] = []
        frontier: list[tuple[float, int, list[int]]] = [(-1.0, -1, [])]  # (-chance, node, path)
        while frontier and len(out) < shape.nodes:
            negative, node, path = heapq.heappop(frontier)
            if len(path) >= limit:
                continue
            context = base + path
            n = index.longest(context)
            follow = index.counts.get(tuple(context[len(context) - n :])) if n else None
            if not follow:
                continue
            total = sum(follow.values())
            best = sorted(follow.items(), key=lambda kv: -kv[1])[: shape.top_k]
            for token, count in best:
                chance = -negative * count / total
                if chance < self.min_token_prob or len(out) >= shape.nodes:
                    break
                out.append(token)
                parents.append(node)
                heapq.heappush(frontier, (-chance, len(out) - 1, [*path, token]))
        return DraftTree(tuple(out), tuple(parents))

    def _own_index(self, req: Request) -> ContextCounts:
        entry = self._own.get(req.request_id)
        if entry is None:
            entry = self._own[req.request_id] = (ContextCounts(self.lengths), [0])
        index, done = entry
        index.add(req.all_token_ids, start=done[0])
        done[0] = len(req.all_token_ids)
        return index

    def finish(self, request: Request) -> None:
        """A request ended: its output joins the shared index (the oldest one leaves)."""
        self._own.pop(request.request_id, None)
        if self.max_cached_requests == 0 or not request.output_token_ids:
            return
        # The output with the prompt's tail as its first contexts.
        tail = request.prompt_token_ids[-max(self.lengths) :]
        tokens = [*tail, *request.output_token_ids]
        self.shared.add(tokens, start=len(tail))
        self._cached.append((tokens, len(tail)))
        if len(self._cached) > self.max_cached_requests:
            old, start = self._cached.popleft()
            self.shared.add(old, start=start, sign=-1)
