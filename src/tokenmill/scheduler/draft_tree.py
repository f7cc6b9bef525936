"""Draft trees: several guesses per position, verified in one step.

A tree of N draft nodes hangs off the request's last known token (the root): node j has
token ``tokens[j]`` and parent ``parents[j]`` (-1: the root), parents before children. A
chain is the tree whose node j has parent j - 1 (``ScheduledSeq.draft_parents`` is then
empty). The step computes the root and every node at once: node j's query sees the
request's context up to the root and its own ancestors (itself included), at rotary
position root + depth(j), while its K/V is stored at position root + 1 + j
(``tree_attention``). Every node samples the token after its path; the longest path
whose nodes equal what was sampled above them is accepted, then the token sampled after
it, and the accepted nodes' K/V are moved to the positions they now hold
(``accepted_moves``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    """-1: the root (the last known token); otherwise an earlier node."""

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or any(
            not -1 <= p < j for j, p in enumerate(self.parents)
        ):
            raise ValueError(f"not a draft tree (parents before children): {self.parents}")

    def cut(self, n: int) -> DraftTree:
        """The first n nodes (still a tree: parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    @functools.cached_property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def main_chain(self) -> list[int]:
        """Tokens of the path through each node's first child (the proposer's best guess)."""
        if self.is_chain:  # (every chain proposal of every step asks)
            return list(self.tokens)
        out: list[int] = []
        node = -1
        while True:
            child = next((j for j, p in enumerate(self.parents) if p == node), None)
            if child is None:
                return out
            out.append(self.tokens[child])
            node = child


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (included)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def accept(tokens: Sequence[int], parents: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The accepted nodes, root down: ``sampled[0]`` is what the root sampled, ``sampled[1
    + j]`` what node j sampled. From the root, go to the child whose token equals what
    was sampled there, while there is one. (Each sample is drawn from the target's
    distribution after its path, so the output is that of plain decoding.)"""
    accepted: list[int] = []
    node, token = -1, sampled[0]
    while True:
        child = next((j for j, p in enumerate(parents) if p == node and tokens[j] == token), None)
        if child is None:
            return accepted
        accepted.append(child)
        node, token = child, sampled[1 + child]


def accepted_moves(root: int, accepted: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) positions of the K/V of accepted nodes that are not where they belong:
    node j is stored at root + 1 + j and belongs at root + depth. Read every source before
    writing any destination: a destination may be another move's source."""
    return [(root + 1 + j, root + d) for d, j in enumerate(accepted, 1) if j != d - 1]
