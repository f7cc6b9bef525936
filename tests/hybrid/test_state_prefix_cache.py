"""Prefix caching of hybrid and state-space models: a later request resumes from a
recurrent-state snapshot (``kv_cache/snapshots.py``) and gets exactly the tokens of a run
without the cache, for every family: a shared 300-token prefix (resumed at the last
64-token snapshot inside it), a second chat turn (resumed one token before the first
turn's prompt end), a prompt shorter than a block, the same prompt again (resumed one token before
its end, inside a block, also after chunked prefill)."""

from __future__ import annotations

import random

import pytest
import torch
from hybrid_checkpoints import (
    VOCAB,
    hybrid_llm,
    make_falcon_h1,
    make_lfm2,
    make_mamba2,
    make_qwen3_5,
)

from tokenmill.inputs import TokensPrompt
from tokenmill.sampling_params import SamplingParams

BUILDERS = {
    "qwen3_5": make_qwen3_5,
    "mamba2": make_mamba2,
    "lfm2": make_lfm2,
    "falcon_h1": make_falcon_h1,
}
ATOL = 2e-5
"""Rounding only (a stale state moves them by 1e-2 here)."""
OPTIONS = {"max_model_len": 400, "num_kv_blocks": 256, "block_size": 16}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family_dir(request, tmp_path_factory, smollm2_hf_tokenizer):
    build = BUILDERS[request.param]
    return build(tmp_path_factory.mktemp(request.param), smollm2_hf_tokenizer, seed=3)


@pytest.fixture(scope="module")
def reference(family_dir):
    """The same model without prefix caching."""
    return hybrid_llm(family_dir, enable_prefix_caching=False, **OPTIONS)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _run(llm, prompt: list[int], n: int = 12) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their log-probs [n]."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    c = out[0].outputs[0]
    return list(c.token_ids), torch.tensor([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)])


def _generate(llm, prompt: list[int], n: int = 12) -> list[int]:
    return _run(llm, prompt, n)[0]


def _same(llm, reference, prompt: list[int]) -> None:
    """Exactly the tokens of the run without the cache, log-probs within rounding."""
    tokens, logprobs = _run(llm, prompt)
    expected, expected_logprobs = _run(reference, prompt)
    assert tokens == expected
    torch.testing.assert_close(logprobs, expected_logprobs, atol=ATOL, rtol=0)


def _restored(llm) -> tuple[int, int]:
    m = llm.get_prefix_cache_metrics()
    return m["recurrent_snapshot_restores"], m["recurrent_snapshot_hit_tokens"]


def test_shared_300_token_prefix(family_dir, reference):
    prefix = _tokens(300, seed=1)
    first, second = prefix + _tokens(9, seed=2), prefix + _tokens(7, seed=3)
    llm = hybrid_llm(family_dir, **OPTIONS)
    assert _generate(llm, first) == _generate(reference, first)
    assert _restored(llm) == (0, 0)
    _same(llm, reference, second)
    assert _restored(llm) == (1, 256)  # the last 64-token snapshot inside the prefix
    metrics = llm.get_prefix_cache_metrics()
    assert metrics["prefix_cache_reused_tokens"] == 256
    assert metrics["recurrent_snapshot_bytes"] > 0


def test_second_chat_turn(family_dir, reference):
    """Turn 2 = turn 1's prompt and answer and a new message: resumed at the snapshot of
    turn 1's last prompt token but one (token-granular: 74 is inside a block)."""
    turn1 = _tokens(75, seed=4)
    answer = _generate(reference, turn1)
    turn2 = turn1 + answer + _tokens(10, seed=5)
    llm = hybrid_llm(family_dir, **OPTIONS)
    assert _generate(llm, turn1) == answer
    _same(llm, reference, turn2)
    restores, hit = _restored(llm)
    assert restores == 1 and hit >= 74


def test_short_prompt_under_one_block(family_dir, reference):
    short = _tokens(5, seed=6)
    longer = short + _tokens(3, seed=7)
    llm = hybrid_llm(family_dir, **OPTIONS)
    assert _generate(llm, short) == _generate(reference, short)
    _same(llm, reference, longer)
    assert _restored(llm) == (1, 4)


@pytest.mark.parametrize(
    "length, chunk",
    [(100, None), (130, None), (100, 32)],
    ids=["in-the-only-chunk", "past-two-intervals", "in-the-last-of-4-chunks"],
)
def test_same_prompt_again(family_dir, reference, length, chunk):
    """The state one token before a prompt's end is kept inside its chunk's scan (not at
    a scan chunk's end) with the K/V of its partial block: the same prompt again resumes
    there and computes only its last token."""
    prompt = _tokens(length, seed=8)
    options = dict(OPTIONS, max_num_batched_tokens=chunk) if chunk else OPTIONS
    llm = hybrid_llm(family_dir, **options)
    assert _generate(llm, prompt) == _generate(reference, prompt)
    _same(llm, reference, prompt)
    assert _restored(llm) == (1, length - 1)
