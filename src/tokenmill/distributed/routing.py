"""Which data-parallel replica takes a request: policies over what the replicas cache.

Each replica publishes the chain hashes of the KV blocks its prefix cache added and
evicted (``block_events.py``); ``PrefixIndex`` mirrors them per replica. A request's own
chain hashes (``kv_cache/prefix.py``: the same function the replica's KV manager uses,
salted the same way) then say how many of its leading blocks each replica holds.

- ``cache_aware``: the replica with the most cached prompt tokens minus a price per
  request it has in flight (``load_weight`` tokens each), ties to the least loaded: a
  conversation's next turn goes where its history is, unless that replica is far busier.
- ``round_robin``: one after another (the baseline).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.kv_cache.prefix import BlockKey, extend_hashes


@dataclass(frozen=True)
class BlockEvents:
    """What one replica's prefix cache did since its last report."""

    added: tuple[bytes, ...]
    evicted: tuple[bytes, ...]


@dataclass
class PrefixIndex:
    """The chain hashes one replica's prefix cache holds (as of its latest report)."""

    hashes: set[bytes] = field(default_factory=set)

    def apply(self, events: BlockEvents) -> None:
        self.hashes.difference_update(events.evicted)
        self.hashes.update(events.added)

    def matched_blocks(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` this replica holds."""
        for i, h in enumerate(chain):
            if h not in self.hashes:
                return i
        return len(chain)


def prompt_chain(prompt_ids: Sequence[int], block_size: int, key: BlockKey = b"") -> list[bytes]:
    """Chain hashes of the prompt's full blocks, keyed as the replica's KV manager keys
    them (``RequestOptions.block_key``: the ``cache_salt`` and the media's hashes)."""
    chain: list[bytes] = []
    extend_hashes(chain, prompt_ids, len(prompt_ids), block_size, key)
    return chain


@dataclass(frozen=True)
class Choice:
    replica: int
    matched_tokens: int
    """Prompt tokens the chosen replica was expected to hold."""


@dataclass
class RouterStats:
    """Counted by the router; ``hit_rate`` is its expectation, the replicas' own prefix
    cache counters say what was reused."""

    routed: Counter[int] = field(default_factory=Counter)
    prompt_tokens: int = 0
    matched_tokens: int = 0
    retried: int = 0
    """Requests re-sent to another replica after theirs died before any output."""
    restarts: int = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Policy:
    """Chooses among the live replicas (indices into ``indexes`` / ``loads``)."""

    def choose(
        self, chain: list[bytes], block_size: int, live: list[int],
        indexes: Sequence[PrefixIndex], loads: Sequence[int],
    ) -> Choice:  # fmt: skip
        raise NotImplementedError


class RoundRobin(Policy):
    def __init__(self) -> None:
        self._next = 0

    def choose(self, chain, block_size, live, indexes, loads) -> Choice:
        replica = live[self._next % len(live)]
        self._next += 1
        return Choice(replica, indexes[replica].matched_blocks(chain) * block_size)


class CacheAware(Policy):
    def __init__(self, load_weight: int = 64) -> None:
        self.load_weight = load_weight
        """Prompt tokens one request in flight is worth (a replica holding 4 blocks of 16
        more than another still loses to it when it has 2 more requests in flight)."""

    def choose(self, chain, block_size, live, indexes, loads) -> Choice:
        def score(r: int) -> tuple[int, int]:
            cached = indexes[r].matched_blocks(chain) * block_size
            return cached - self.load_weight * loads[r], -loads[r]

        best = max(live, key=score)
        return Choice(best, indexes[best].matched_blocks(chain) * block_size)


POLICIES: dict[str, Callable[[], Policy]] = {"cache_aware": CacheAware, "round_robin": RoundRobin}
