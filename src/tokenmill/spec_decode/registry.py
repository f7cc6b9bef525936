"""Method name -> proposer factory (lazy imports: a method's code loads when it is used)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.spec_decode.adaptive import DraftLength
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposer import DraftHook, Proposer, TreeShape

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.loading import LoadedModel
    from tokenmill.kv_cache import KVCacheCoordinator, KVCacheManager
    from tokenmill.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class TargetParts:
    """What a proposer may need of the target engine."""

    config: EngineConfig
    loaded: LoadedModel
    runner: ModelRunner
    kv: KVCacheManager | KVCacheCoordinator


def _ngram(spec: SpeculativeConfig, target: TargetParts) -> Proposer:
    from tokenmill.spec_decode.ngram import NgramProposer

    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _suffix(spec: SpeculativeConfig, target: TargetParts) -> Proposer:
    from tokenmill.spec_decode.suffix import SuffixProposer

    return SuffixProposer(
        spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
        spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
    )  # fmt: skip


def _draft_model(spec: SpeculativeConfig, target: TargetParts) -> Proposer:
    from tokenmill.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer.build(spec, target)


def _head(spec: SpeculativeConfig, target: TargetParts) -> Proposer:
    from tokenmill.spec_decode.head_proposer import build_head_proposer

    return build_head_proposer(spec, target)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, TargetParts], Proposer]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
    "eagle3": _head,
    "mtp": _head,
}


def build_draft_hook(spec: SpeculativeConfig, target: TargetParts, budget: int) -> DraftHook:
    """The engine's draft hook: the method's proposer; with ``spec.adaptive`` the draft
    cap chosen per step from the verify cost measured on ``target.runner`` (and, for a
    draft model, the cost of its own steps measured on its runner)."""
    from tokenmill.spec_decode.adaptive import CostCurve
    from tokenmill.spec_decode.calibrate import measure_cost_curve
    from tokenmill.spec_decode.draft_model import DraftModelProposer
    from tokenmill.spec_decode.head_proposer import HeadProposer

    proposer = PROPOSERS[spec.method](spec, target)
    k = spec.num_speculative_tokens
    curve, proposal = CostCurve.linear(), None
    if spec.adaptive:
        seqs = target.config.max_num_seqs
        curve = measure_cost_curve(target.runner, target.kv, k, budget, seqs)
        if isinstance(proposer, DraftModelProposer):  # its one-token steps cost too
            proposal = measure_cost_curve(proposer.runner, proposer.kv, 0, budget, seqs)
        elif isinstance(proposer, HeadProposer):
            proposal = proposer.measure_step_cost(seqs)
    if isinstance(proposer, HeadProposer):  # features from now on (not the scratch steps')
        proposer.attach()
    tree = TreeShape(spec.draft_top_k, spec.tree_nodes) if spec.is_tree else None
    return DraftHook(proposer, k, DraftLength(k, curve, spec.adaptive, proposal), tree)
