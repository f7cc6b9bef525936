"""How many drafts to verify this step: expected tokens per second, from each request's
acceptance so far and the measured cost of a step by its token count.

A step of T tokens costs ``c(T)`` (``CostCurve``, measured at start-up). With drafts of
length up to k, a request with per-token acceptance ``a`` yields ``1 + a + ... + a^k``
tokens on average (drafts are accepted left to right until the first miss; one more
token is sampled either way). The step's draft cap is the k in 0..K that maximises
expected tokens / c(T(k)); k = 0, speculation off for the step, wins where verifying
costs more than it returns (large batches, low acceptance). A step every
``EXPLORE_EVERY`` that chose 0 still drafts one token, so acceptance keeps being measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

EXPLORE_EVERY = 8
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0
"""Pseudo-trials of the prior: a request's own history outweighs it after a few steps."""


@dataclass(frozen=True)
class CostCurve:
    """Relative step time by tokens in the step: c(T), interpolated between measured T
    and extrapolated linearly beyond the last (monotone: never cheaper with more)."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def from_points(cls, points: Mapping[int, float]) -> CostCurve:
        ts = sorted(points)
        secs, best = [], 0.0
        for t in ts:
            best = max(best, points[t])  # noise never makes more tokens cheaper
            secs.append(best)
        return cls(tuple(ts), tuple(secs))

    @classmethod
    def linear(cls) -> CostCurve:
        """Cost proportional to tokens (no measurement: speculation only where it must pay)."""
        return cls((1, 2), (1.0, 2.0))

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        t = np.asarray(tokens, dtype=np.float64)
        xs, ys = np.asarray(self.tokens, np.float64), np.asarray(self.seconds, np.float64)
        out = np.interp(t, xs, ys)
        if len(xs) >= 2:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out = np.where(t > xs[-1], ys[-1] + slope * (t - xs[-1]), out)
        return out

    def ratio(self, k: int) -> float:
        """t(k) / t(1): one sequence verifying k - 1 drafts against a plain decode."""
        return float(self(np.array([k]))[0] / self(np.array([1]))[0])


@dataclass
class Acceptance:
    """Left-to-right acceptance counts: ``successes`` accepted drafts over ``trials``
    (accepted drafts plus first misses)."""

    successes: float = 0.0
    trials: float = 0.0

    def add(self, drafted: int, accepted: int) -> None:
        self.successes += accepted
        self.trials += accepted + (accepted < drafted)

    def rate(self, prior: float) -> float:
        return (self.successes + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)


@dataclass
class DraftLength:
    """Chooses each step's draft cap (see the module docstring)."""

    max_tokens: int
    curve: CostCurve
    adaptive: bool = True
    proposal: CostCurve | None = None
    """A proposer that runs model steps (a draft model): the cost of one of its steps by
    the sequences drafting; a cap of k costs k of them on top of the verification."""
    overall: Acceptance = field(default_factory=Acceptance)
    _steps_off: int = 0

    def prior(self) -> float:
        return self.overall.rate(PRIOR_ACCEPTANCE)

    def choose(
        self,
        num_plain: int,
        rates: Sequence[float],
        lengths: Sequence[int],
        nodes: Sequence[Sequence[int]] | None = None,
    ) -> int:
        """The draft cap for a step where ``num_plain`` sequences take no drafts and the
        others have proposals of ``lengths`` with acceptance ``rates``; with draft trees,
        ``nodes[r][j - 1]`` is how many nodes request r's tree has down to depth j (what
        verifying it costs: the gain is still counted along its first branch)."""
        if not self.adaptive:
            return self.max_tokens
        a = np.asarray(rates, dtype=np.float64)[:, None]  # [R, 1]
        lens = np.asarray(lengths, dtype=np.int64)[:, None]
        j = np.arange(1, self.max_tokens + 1)[None, :]  # [1, K]
        used = j <= lens  # [R, K]: draft j exists under cap k >= j
        gain = np.cumsum(np.where(used, a**j, 0.0), axis=1).sum(axis=0)  # [K]
        if nodes is None:
            extra = np.cumsum(used, axis=1).sum(axis=0)  # [K] tokens added under cap k
        else:
            extra = np.asarray(nodes, dtype=np.int64).sum(axis=0)
        base = num_plain + len(rates)
        expected = np.concatenate(([base], base + gain))
        tokens = np.concatenate(([base], base + extra))
        cost = self.curve(tokens)
        if self.proposal is not None:
            cost[1:] += np.arange(1, self.max_tokens + 1) * self.proposal(np.array([len(rates)]))
        k = int(np.argmax(expected / cost))
        if k == 0:
            self._steps_off += 1
            if self._steps_off % EXPLORE_EVERY == 0:
                return 1
        return k
