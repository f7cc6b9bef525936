"""Speculative decoding on hybrid and state-space models: a verify step keeps the
recurrent state after each draft position and the slot rolls back to the accepted ones
(``worker/state_rollback.py``), so greedy output is exactly that of plain decoding, for
every family (Qwen3.5, Mamba2, LFM2, Falcon-H1), alone and batched, with prompt lookup
and suffix drafts, prefix-cache hits on snapshots taken while speculating, preemption
and aborts, and ``disable_spec_decode``.

The checkpoints' output heads keep 8 tokens (``narrow_head``): greedy output repeats, so
prompt lookup proposes drafts and both accepted and rejected ones occur (asserted from
the engine's counters), while which token comes next still depends on the whole state:
without the rollback every family's output here differs from plain decoding.
"""

from __future__ import annotations

import random

import pytest
import torch
from hybrid_checkpoints import (
    hybrid_llm,
    make_falcon_h1,
    make_lfm2,
    make_mamba2,
    make_qwen3_5,
    narrow_head,
)

from tokenmill.errors import InvalidRequestError
from tokenmill.inputs import TokensPrompt
from tokenmill.kv_cache import make_kv_cache
from tokenmill.kv_cache.spec import FullAttention, RecurrentState
from tokenmill.sampling_params import SamplingParams

BUILDERS = {
    "qwen3_5": make_qwen3_5,
    "mamba2": make_mamba2,
    "lfm2": make_lfm2,
    "falcon_h1": make_falcon_h1,
}
SEEDS = {"mamba2": 2}
"""Checkpoint seeds other than 0: Mamba2's seed-0 checkpoint settles into a 2-cycle that
no rejected draft disturbs (its output would not show a missing rollback)."""
IDS = list(range(10, 18))
"""The tokens the narrowed heads can produce; prompts are drawn from them too."""
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
TOKENS = 24


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_dir(request, tmp_path_factory, smollm2_hf_tokenizer):
    build, seed = BUILDERS[request.param], SEEDS.get(request.param, 0)
    path = build(tmp_path_factory.mktemp(request.param), smollm2_hf_tokenizer, seed=seed)
    return narrow_head(path, IDS)


@pytest.fixture(scope="module")
def plain(family_dir):
    return hybrid_llm(family_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def spec(family_dir):
    return hybrid_llm(family_dir, speculative_config=NGRAM)


def _prompts(n: int, seed: int, longest: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(IDS) for _ in range(rng.randrange(6, longest))] for _ in range(n)]


def _run(llm, prompts, tokens: int = TOKENS, **params) -> list[list[int]]:
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **params)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                        use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in outs]


def _counts(llm) -> tuple[int, int]:
    """(drafted, accepted) tokens so far."""
    m = llm.get_scheduling_metrics()
    return m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]


def _assert_all_free(llm) -> None:
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks


def test_ngram_equals_plain_with_accepted_and_rejected_drafts(plain, spec):
    prompts = _prompts(3, seed=0)
    drafted, accepted = _counts(spec)
    got = [_run(spec, [p])[0] for p in prompts]
    assert got == _run(plain, prompts)
    drafted, accepted = (a - b for a, b in zip(_counts(spec), (drafted, accepted)))
    assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)
    _assert_all_free(spec)


def test_batch_equals_single(plain, spec):
    prompts = _prompts(4, seed=1)
    batched = _run(spec, prompts)
    assert batched == [_run(spec, [p])[0] for p in prompts]
    assert batched == _run(plain, prompts)


def test_suffix_decoding_with_prefix_hits(family_dir, plain):
    """The first request speculates past position 64 (a snapshot there, taken inside a
    verify step, maybe among rejected drafts); the second, its prompt and output plus
    more, resumes from it."""
    with hybrid_llm(family_dir, speculative_config={**NGRAM, "method": "suffix"}) as llm:
        first = _prompts(1, seed=3)[0]
        out = _run(llm, [first], tokens=80 - len(first))[0]
        assert out == _run(plain, [first], tokens=80 - len(first))[0]
        second = first + out + _prompts(1, seed=4, longest=10)[0]
        assert _run(llm, [second], tokens=20) == _run(plain, [second], tokens=20)
        metrics = llm.get_prefix_cache_metrics()
        assert metrics["recurrent_snapshot_restores"] > 0
        assert metrics["recurrent_snapshot_hit_tokens"] >= 64
        drafted, accepted = _counts(llm)
        assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)
        _assert_all_free(llm)


def test_preemption_abort_and_async_scheduling(family_dir, plain):
    """5 sequences of up to 53 tokens in 24 blocks of 4 and 3 state slots: preempted while
    speculating (with a step in flight) and recomputed; then a request aborted while it
    speculates. Every block and slot comes back (the integrity check runs after every
    step)."""
    prompts = _prompts(5, seed=5)
    options = dict(num_kv_blocks=24, max_model_len=96, ssm_state_cache_size=3,
                   speculative_config=NGRAM, async_scheduling="on")  # fmt: skip
    with hybrid_llm(family_dir, **options) as llm:
        assert _run(llm, prompts) == _run(plain, prompts)
        assert llm.engine.scheduler.num_preemptions > 0
        assert _counts(llm)[1] > 0
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        drafted = _counts(llm)[0]
        rid = engine.add_request(prompts[0] * 2, params)
        while _counts(llm)[0] == drafted or engine.scheduler.requests[rid].num_output_tokens < 8:
            engine.step()
        engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        _assert_all_free(llm)


def test_disable_spec_decode_per_request(plain, spec):
    prompts = _prompts(3, seed=6)
    drafted = _counts(spec)[0]
    assert _run(spec, prompts, disable_spec_decode=True) == _run(plain, prompts)
    assert _counts(spec)[0] == drafted


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return narrow_head(make_qwen3_5(tmp_path_factory.mktemp("q35"), smollm2_hf_tokenizer), IDS)


def test_draft_model_and_adaptive_length(qwen35_dir, tiny_llama_dir):
    """An attention-only draft for a hybrid target (its drafts are mostly rejected), with
    the adaptive length on: the start-up verify-cost measurement runs on state slots."""
    prompts = _prompts(2, seed=8)
    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    want = _run(hybrid_llm(qwen35_dir, enable_prefix_caching=False), prompts)
    with hybrid_llm(qwen35_dir, speculative_config=draft) as llm:
        assert _run(llm, prompts) == want
        _assert_all_free(llm)


def test_what_is_not_built_is_refused(qwen35_dir):
    with pytest.raises(InvalidRequestError, match="draft trees .* not supported for hybrid"):
        hybrid_llm(qwen35_dir, speculative_config={**NGRAM, "draft_top_k": 2})
    with pytest.raises(InvalidRequestError, match=r"\(eagle3\) is not supported for hybrid"):
        hybrid_llm(qwen35_dir, speculative_config={"method": "eagle3", "model": "head"})


def test_rejected_drafts_give_back_their_snapshot_rows():
    """A verify step from 62 to 66 reserves the row of position 64; drafts rejected back
    to 63 give it back, and 64 is reserved again when a later step reaches it."""
    specs = [FullAttention(2, 8, torch.float32), RecurrentState((16,), torch.float32)]
    kv = make_kv_cache(specs, 32, 4, num_slots=2, snapshot_rows=4)
    prompt = list(range(3, 65))  # 62 tokens: a snapshot at its last token but one (61)
    assert kv.get_computed_blocks("a", prompt) == 0 and kv.allocate_slots("a", 62)
    assert kv.state_step(["a"]).run_saves == (((61, 0),),)
    kv.commit("a", prompt, 62)
    assert kv.allocate_slots("a", 66)  # the last token and 3 drafts
    assert kv.state_step(["a"]).run_saves == (((2, 1),),)  # 64 is 2 tokens into the run
    kv.truncate("a", 63)  # every draft rejected
    kv.check_integrity()
    assert [p.position for p in kv.snapshots._pending["a"]] == []
    kv.commit("a", [*prompt, 7], 63)
    assert kv.allocate_slots("a", 65)
    assert kv.state_step(["a"]).run_saves == (((1, 1),),)
    kv.free("a")
    kv.check_integrity()
