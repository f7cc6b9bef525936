"""Hybrid and state-space families under tensor and pipeline parallelism (gloo ranks on the
CPU): greedy tokens equal the one-process engine's for a batch of prompts of different
lengths under preemption, then a repeated prompt resumed from a recurrent-state snapshot
(the hybrid prefix cache, each rank restoring its own part of the state); sizes that can
not split are clear errors before any worker starts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "hybrid"))
import hybrid_checkpoints as hc  # noqa: E402

from tokenmill.distributed.hybrid_split import SpreadGroupNorm  # noqa: E402
from tokenmill.errors import UnsupportedModelError  # noqa: E402
from tokenmill.executor.multiproc import MultiprocExecutor  # noqa: E402

Probe = Callable[[Any], None]
STEPS = 6
PROMPTS = hc.random_prompts(5, seed=1, longest=40)
OPTIONS = {"num_kv_blocks": 20, "max_model_len": 64, "ssm_state_cache_size": 5,
           "recurrent_snapshot_pool_bytes": 1 << 21}  # fmt: skip
"""20 blocks of 4 tokens for 5 sequences of up to 46: some are preempted and recomputed."""
MAKERS = {
    "qwen3_5": hc.make_qwen3_5,
    # Qwen3_5ForConditionalGeneration: text_config, model.language_model.*, model.visual.*
    "qwen3_5_vl": hc.make_qwen3_5_vl,
    # one group of B / C for all 8 heads: each rank's gated norm sums over both ranks
    "mamba2_one_group": lambda p, tok: hc.make_mamba2(p, tok, n_groups=1),
    "lfm2": hc.make_lfm2,
    "falcon_h1": hc.make_falcon_h1,
    "qwen3_next_dense": hc.make_qwen3_next_dense,  # DeltaNet projections grouped per key head
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_hf_tokenizer):
    root = tmp_path_factory.mktemp("hybrid_parallel")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = MAKERS[family](root / family, smollm2_hf_tokenizer)
        return made[family]

    return get


def _session(path: Path, probe: Probe | None = None, **sizes) -> tuple[list, list, int, int]:
    """The batch's greedy tokens, then a second turn of prompt 1 (resumed from the snapshot
    of its first turn), the preemptions and the snapshot restores. ``probe``: called with
    the parallel engines first."""
    with hc.hybrid_llm(path, **OPTIONS, **sizes) as llm:
        if sizes:
            assert isinstance(llm.engine.executor, MultiprocExecutor)
            if probe is not None:
                probe(llm)
        batch = [t for t, _ in hc.tokenmill_greedy(llm, PROMPTS, STEPS)]
        [(turn1, _)] = hc.tokenmill_greedy(llm, [PROMPTS[1]], STEPS)
        turn2 = PROMPTS[1] + turn1 + [7, 8, 9]  # resumes at turn 1's prompt end but one
        [(again, _)] = hc.tokenmill_greedy(llm, [turn2], STEPS)
        restores = llm.get_prefix_cache_metrics()["recurrent_snapshot_restores"]
        if sizes.get("tensor_parallel_size", 1) > 1 and "mamba2" in str(path):
            local = llm.engine.loaded.model.local
            norms = [m for m in local.modules() if isinstance(m, SpreadGroupNorm)]
            assert len(norms) == len(local.layers) > 0  # every layer's norm spans two ranks
        return batch, again, llm.engine.scheduler.num_preemptions, restores


def _check(checkpoints, family: str, sizes: list[dict], probe: Probe | None = None) -> None:
    path = checkpoints(family)
    ref_batch, ref_again, ref_preempted, ref_restores = _session(path)
    assert ref_preempted > 0 and ref_restores > 0  # the case is what it claims to be
    for size in sizes:
        batch, again, preempted, restores = _session(path, probe, **size)
        assert batch == ref_batch, size
        assert again == ref_again, size
        assert preempted > 0 and restores == ref_restores, size


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2_one_group"])
def test_tp2_and_pp2_greedy_equal_one_process(checkpoints, family):
    _check(checkpoints, family, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm2", "falcon_h1", "qwen3_next_dense"])
def test_other_families_tp2_and_pp2(checkpoints, family):
    _check(checkpoints, family, [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])


def _driver_encodes(llm) -> None:
    """The driver holds the whole vision tower, no other rank does (image requests against
    one process: ``test_media_parallel.py``, with a tokenizer that has the image tokens)."""
    assert llm.engine.loaded.model.local.visual is not None
    assert llm.llm_engine.mm_processor is not None


def test_qwen3_5_vision_checkpoint_tp2_and_pp2(checkpoints):
    """The real Qwen3.5 checkpoints' layout (text_config, model.language_model.*, a
    model.visual.* tower): the stage and shard cuts reach the language model's config,
    the tower stays whole on the driver."""
    sizes = [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}]
    _check(checkpoints, "qwen3_5_vl", sizes, probe=_driver_encodes)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_vl", "mamba2_one_group"])
def test_tp2_x_pp2_greedy_equals_one_process(checkpoints, family):
    _check(checkpoints, family, [{"tensor_parallel_size": 2, "pipeline_parallel_size": 2}])


@pytest.mark.parametrize(
    "family, options, match",
    [
        ("mamba2_one_group", {"tensor_parallel_size": 3}, "num_heads=8 is not divisible by 3"),
        ("qwen3_5", {"tensor_parallel_size": 4}, "linear_num_key_heads=2 is not divisible by 4"),
        ("lfm2", {"tensor_parallel_size": 3}, "hidden_size.*=64 is not divisible by 3"),
    ],
)
def test_bad_splits_are_refused_before_any_worker(checkpoints, family, options, match):
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        hc.hybrid_llm(checkpoints(family), **options)
    assert time.monotonic() - started < 5


def test_a_last_stage_without_state_layers_is_refused(tmp_path, smollm2_hf_tokenizer):
    """Stage 0 holds the DeltaNet layers, the last stage (the driver, which keeps the
    scheduler's cache groups) attention only."""
    types = ["linear_attention", "linear_attention", "full_attention", "full_attention"]
    path = hc.make_qwen3_5(tmp_path / "m", smollm2_hf_tokenizer, layer_types=types)
    with pytest.raises(UnsupportedModelError, match="last pipeline stage.*has no state layer"):
        hc.hybrid_llm(path, pipeline_parallel_size=2)


SPEC_IDS = list(range(10, 18))
"""The tokens the narrowed heads produce (``hc.narrow_head``): greedy output repeats, so
prompt lookup proposes drafts, some accepted and some rejected."""


@pytest.fixture(scope="module")
def narrowed(tmp_path_factory, smollm2_hf_tokenizer):
    def get(family: str) -> Path:
        path = MAKERS[family](tmp_path_factory.mktemp(f"narrow_{family}"), smollm2_hf_tokenizer)
        return hc.narrow_head(path, SPEC_IDS)

    return get


def _speculate(path: Path, **options) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of 4 prompts (drawn from the head's tokens) with prompt lookup, and
    the (drafted, accepted) counts; one prompt alone first, then the batch."""
    import random

    from tokenmill import SamplingParams
    from tokenmill.inputs import TokensPrompt

    rng = random.Random(0)
    prompts = [[rng.choice(SPEC_IDS) for _ in range(rng.randrange(6, 30))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    with hc.hybrid_llm(path, speculative_config=ngram, **options) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
        outs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                             use_tqdm=False)  # fmt: skip
        m = llm.get_scheduling_metrics()
        kv = llm.engine.kv
        kv.check_integrity()
        assert kv.slots.num_free == kv.slots.num_slots
    drafted, accepted = m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]
    return [list(o.outputs[0].token_ids) for o in outs], drafted, accepted


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2_one_group"])
def test_speculative_decoding_rolls_back_every_ranks_state(narrowed, family):
    """Prompt lookup on a hybrid under TP=2 and PP=2: each worker keeps its part of every
    draft position's state and copies the accepted one into its slot when the driver
    says (``worker.StepRollback``), so greedy tokens equal one process's, with accepted
    and rejected drafts; without the workers' copies the tokens part."""
    path = narrowed(family)
    ref, drafted, accepted = _speculate(path)
    assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)
    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        got, got_drafted, got_accepted = _speculate(path, **sizes)
        assert got == ref, sizes
        assert (got_drafted, got_accepted) == (drafted, accepted), sizes
    # two steps in flight: the workers' rows wait in launch order for their step's copies
    got, _, _ = _speculate(path, tensor_parallel_size=2, async_scheduling="on")
    assert got == ref
