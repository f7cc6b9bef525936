"""Prompt lookup (n-gram) drafts: what followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max].

Each request keeps an index ``n -> {n-gram: end of its latest occurrence}`` over its own
tokens (prompt and output), extended by the tokens that arrived since the last call, so a
proposal costs O(max - min) dictionary lookups however long the request is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.scheduler.draft_tree import DraftTree
from tokenmill.scheduler.request import Request
from tokenmill.spec_decode.proposer import TreeShape


@dataclass
class NgramIndex:
    """n-grams of one token sequence, each mapped to the end of its latest occurrence;
    the n-grams ending at the sequence's last token are indexed only once a later token
    exists (a match must have something after it)."""

    min_n: int
    max_n: int
    indexed: int = 0
    """Tokens whose ending n-grams are in ``ends`` (all but the newest)."""
    ends: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    earlier: dict[int, dict[int, int]] | None = None
    """With trees: n -> {end: the end of the same n-gram's occurrence before it}."""

    def extend(self, tokens: Sequence[int]) -> None:
        upto = len(tokens) - 1  # the last token's n-grams wait for a successor
        for end in range(max(self.indexed, 1), upto + 1):  # n-grams ending before `end`
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends = self.ends.setdefault(n, {})
                key = tuple(tokens[end - n : end])
                if self.earlier is not None and key in ends:
                    self.earlier.setdefault(n, {})[end] = ends[key]
                ends[key] = end
        self.indexed = max(self.indexed, upto + 1)

    def occurrences(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Ends of the longest suffix's earlier occurrences, latest first (at most limit)."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.ends.get(n, {}).get(tuple(tokens[len(tokens) - n :]))
            if end is None:
                continue
            out, before = [end], (self.earlier or {}).get(n, {})
            while len(out) < limit and out[-1] in before:
                out.append(before[out[-1]])
            return out
        return []

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix's latest earlier occurrence."""
        ends = self.occurrences(tokens, 1)
        return list(tokens[ends[0] : ends[0] + k]) if ends else []


class NgramProposer:
    """``Proposer`` of prompt-lookup drafts (vLLM's method ``ngram``)."""

    name = "ngram"
    costly = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        out = []
        for req in requests:
            index = self._index.get(req.request_id)
            if index is None:
                index = self._index[req.request_id] = NgramIndex(self.min_n, self.max_n)
            out.append(index.propose(req.all_token_ids, k))
        return out

    def propose_tree(
        self, requests: Sequence[Request], k: int, shape: TreeShape
    ) -> list[DraftTree]:
        """Per request, what followed the longest suffix's latest occurrences (up to 4 x
        top_k of them) as a tree: a node per distinct continuation prefix, at most
        ``shape.top_k`` children each, the most frequent (then the latest) first."""
        out = []
        for req in requests:
            index = self._index.get(req.request_id)
            if index is None or index.earlier is None:
                index = self._index[req.request_id] = NgramIndex(self.min_n, self.max_n)
                index.earlier = {}
            tokens = req.all_token_ids
            ends = index.occurrences(tokens, 4 * shape.top_k)
            out.append(continuation_tree([tokens[e : e + k] for e in ends], shape))
        return out

    def finish(self, request: Request) -> None:
        self._index.pop(request.request_id, None)


def continuation_tree(continuations: Sequence[Sequence[int]], shape: TreeShape) -> DraftTree:
    """A draft tree of token sequences' shared prefixes (latest sequence first): a node's
    children are its ``shape.top_k`` most frequent next tokens (ties: the one seen first),
    at most ``shape.nodes`` nodes, breadth first."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [(-1, list(range(len(continuations))), 0)]  # (node, sequences under it, depth)
    while frontier and len(tokens) < shape.nodes:
        node, members, depth = frontier.pop(0)
        groups: dict[int, list[int]] = {}
        for m in members:
            if depth < len(continuations[m]):
                groups.setdefault(continuations[m][depth], []).append(m)
        ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        for token, under in ranked[: shape.top_k]:
            if len(tokens) >= shape.nodes:
                break
            tokens.append(token)
            parents.append(node)
            frontier.append((len(tokens) - 1, under, depth + 1))
    return DraftTree(tuple(tokens), tuple(parents))
