"""Draft proposals: a ``Proposer`` guesses requests' next tokens; the step verifies them.

``DraftHook`` asks the proposer before every step for the running requests that can take
drafts, cuts the proposals to the step's draft cap (``adaptive.DraftLength``) and leaves
them in ``Request.spec_token_ids``; the scheduler schedules them after the request's
last token, the runner samples at each of their positions, and the scheduler keeps the
accepted prefix and rolls back the rest (``Scheduler.update``). Once the step has been
applied, the hook counts what was accepted (``SpecDecodeStats``, each request's rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tokenmill.engine.hooks import RequestHook
from tokenmill.scheduler.draft_tree import DraftTree, depths
from tokenmill.scheduler.request import Request, RequestStatus
from tokenmill.spec_decode.adaptive import EXPLORE_EVERY, Acceptance, CostCurve, DraftLength
from tokenmill.spec_decode.metrics import SpecDecodeStats

if TYPE_CHECKING:
    from tokenmill.scheduler import SchedulerOutput


class Proposer(Protocol):
    name: str
    """The method's name in metrics (ngram, suffix, draft_model...)."""
    costly: bool
    """Whether proposing costs model steps (a draft model): then the step's draft cap is
    chosen before proposing, and only that many are drafted."""

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        """Per request, up to ``k`` guesses of the tokens after its ``all_token_ids``."""
        ...

    def finish(self, request: Request) -> None:
        """The request ended: forget what was kept for it."""
        ...


@dataclass(frozen=True)
class TreeShape:
    """How wide a draft tree grows: ``top_k`` guesses per position, at most ``nodes``
    nodes (``verify_tree_size``)."""

    top_k: int
    nodes: int


def _nodes_by_depth(tree: DraftTree, k: int) -> list[int]:
    """How many of the tree's nodes lie at depth <= j, for j = 1..k."""
    counts = [0] * (k + 1)
    for d in depths(tree.parents):
        counts[min(d, k)] += 1
    out, total = [], 0
    for j in range(1, k + 1):
        total += counts[j]
        out.append(total)
    return out


def _renumber(parents: Sequence[int], keep: list[int]) -> list[int]:
    """Parents of the kept nodes (each kept node's parent is kept: depths only shrink)."""
    where = {old: new for new, old in enumerate(keep)}
    return [-1 if parents[j] < 0 else where[parents[j]] for j in keep]


class DraftHook(RequestHook):
    """Fills ``spec_token_ids`` of running requests from a proposer, at most
    ``num_tokens`` per step (fewer where ``length`` says more would not pay). Requests in
    their prefill, with a token still in flight, with ``disable_spec_decode`` or with a
    grammar still undecided or reasoning get none; a grammar's drafts are cut to what it
    allows (``StructuredRequest.valid_drafts``)."""

    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        length: DraftLength | None = None,
        tree: TreeShape | None = None,
    ) -> None:
        self.proposer = proposer
        self.tree = tree
        """Draft trees of this shape (a proposer with ``propose_tree``); None: chains."""
        self.num_tokens = num_tokens
        self.length = length or DraftLength(num_tokens, CostCurve.linear(), adaptive=False)
        self.stats = SpecDecodeStats(proposer.name, num_tokens)
        self._rates: dict[str, Acceptance] = {}
        self._verifying: list[tuple[Request, int, int]] = []
        """(request, drafts, outputs before the step) of the steps not yet counted."""
        self._drafting = True
        """The latest step that looked drafted something (``needs_tokens``)."""
        self._idle_steps = 0

    @property
    def needs_tokens(self) -> bool:
        """Whether the next step should see every token on the host (asynchronous
        scheduling then waits for the step in flight): drafts follow known tokens only.
        True while drafting pays; once a step drafted nothing (no proposal, or a cap of
        0), steps may overlap again, and every ``EXPLORE_EVERY``-th one looks again."""
        return self._drafting or self._idle_steps % EXPLORE_EVERY == EXPLORE_EVERY - 1

    def before_step(self, running: Sequence[Request]) -> None:
        self._count_verified()
        eligible = [
            req for req in running
            if not (req.num_placeholders or req.num_drafts_in_flight
                    or (req.structured is not None and not req.structured.takes_drafts)
                    or req.params.disable_spec_decode
                    or req.num_computed_tokens < req.num_tokens - 1)  # still prefilling
        ]  # fmt: skip
        if not eligible:
            self._idle_steps += 1
            return
        drafted = self._propose(len(running), eligible)
        self._drafting = drafted
        self._idle_steps = 0 if drafted else self._idle_steps + 1

    def _propose(self, num_running: int, eligible: list[Request]) -> bool:
        """Set the eligible requests' drafts; whether any got some."""
        k = self.num_tokens
        costly = getattr(self.proposer, "costly", False)
        if costly:  # the cap first: drafting costs steps, so only that many are drafted
            nodes = None
            if self.tree is not None:  # a full tree to depth j: at most j x top_k nodes
                full = [min(self.tree.nodes, j * self.tree.top_k) for j in range(1, k + 1)]
                nodes = [full] * len(eligible)
            k = self._cap(num_running, eligible, [k] * len(eligible), nodes)
            if k == 0:
                return False
        proposals = self._proposals(eligible, k)
        drafting = [(req, p) for req, p in zip(eligible, proposals) if p.tokens]
        if not drafting:
            return False
        cap = k
        if not costly:  # cheap proposals: the cap from their actual lengths (and trees)
            lengths = [len(p.main_chain()) for _, p in drafting]
            nodes = None if self.tree is None else [_nodes_by_depth(p, k) for _, p in drafting]
            cap = self._cap(num_running, [r for r, _ in drafting], lengths, nodes)
        if cap == 0:
            return False
        for req, p in drafting:
            if req.structured is not None:  # a chain, only what its grammar allows
                req.spec_token_ids = req.structured.valid_drafts(p.main_chain()[:cap])
            elif p.is_chain:
                req.spec_token_ids = list(p.tokens[:cap])
            else:  # a tree: no deeper than the cap
                keep = [j for j, d in enumerate(depths(p.parents)) if d <= cap]
                req.spec_token_ids = [p.tokens[j] for j in keep]
                req.spec_parents = _renumber(p.parents, keep)
        return True

    def _proposals(self, requests: list[Request], k: int) -> list[DraftTree]:
        """Chains as one-branch trees; a proposer that builds trees builds them when asked
        (``tree``)."""
        if self.tree is not None and hasattr(self.proposer, "propose_tree"):
            return self.proposer.propose_tree(requests, k, self.tree)
        return [DraftTree.chain(p) for p in self.proposer.propose(requests, k)]

    def _cap(
        self,
        num_running: int,
        requests: Sequence[Request],
        lengths: list[int],
        nodes: list[list[int]] | None = None,
    ) -> int:
        prior = self.length.prior()
        rates = [self._rates.get(r.request_id, Acceptance()).rate(prior) for r in requests]
        return self.length.choose(num_running - len(requests), rates, lengths, nodes)

    def on_scheduled(self, sched: SchedulerOutput) -> None:
        c = sched.cols
        for i, drafts in c.drafts.items():
            req = c.requests[i]
            parents = c.parents.get(i)
            # a tree counts as deep as it goes: at most that many drafts are accepted
            drafted = max(depths(parents)) if parents else len(drafts)
            self._verifying.append((req, drafted, req.num_output_tokens))

    def on_finish(self, request: Request) -> None:
        self._count_verified()
        self._rates.pop(request.request_id, None)
        self.proposer.finish(request)

    def _count_verified(self) -> None:
        """Count the acceptance of steps whose result has been applied."""
        if not self._verifying:
            return
        waiting = []
        for entry in self._verifying:
            req, drafted, before = entry
            if req.num_drafts_in_flight and not req.is_finished:
                waiting.append(entry)
                continue
            if req.status is RequestStatus.FINISHED_ABORTED and req.num_drafts_in_flight:
                continue  # aborted before its step landed: nothing was verified
            accepted = max(0, min(drafted, req.num_output_tokens - before - 1))
            self.stats.add(drafted, accepted)
            self.length.overall.add(drafted, accepted)
            if not req.is_finished:
                self._rates.setdefault(req.request_id, Acceptance()).add(drafted, accepted)
        self._verifying = waiting
