"""Prompt lookup (n-gram) drafts: what followed the latest earlier occurrence of the
request's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max].

Each request keeps an index ``n -> {n-gram: end of its latest occurrence}`` over its own
tokens (prompt and output), extended by the tokens that arrived since the last call, so a
proposal costs O(max - min) dictionary lookups however long the request is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.scheduler.request import Request


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

    def extend(self, tokens: Sequence[int]) -> None:
        upto = len(tokens) - 1  # the last token's n-grams wait for a successor
        for end in range(max(self.indexed, 1), upto + 1):  # n-grams ending before `end`
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends.setdefault(n, {})[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, upto + 1)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix's latest earlier occurrence."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self.ends.get(n, {}).get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return list(tokens[end : end + k])
        return []


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

    def finish(self, request: Request) -> None:
        self._index.pop(request.request_id, None)
