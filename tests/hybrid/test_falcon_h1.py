"""Falcon-H1 (attention and a Mamba2 mixer in parallel in each layer, muP multipliers)
against transformers on random weights: one prompt, a batch of 12 under preemption,
chunked prefill, and the mixer without its gated RMSNorm."""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import (
    assert_matches_hf,
    hf_greedy,
    hybrid_llm,
    make_falcon_h1,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill.kv_cache import KVCacheCoordinator
from tokenmill.kv_cache.spec import FullAttention, RecurrentState

STEPS = 32
ATOL = 2e-4


@pytest.fixture(scope="module")
def falcon_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_falcon_h1(tmp_path_factory.mktemp("falcon_h1"), smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def hf_falcon(falcon_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(falcon_dir, dtype=torch.float32).eval()


def test_single_prompt_equals_transformers_generate(falcon_dir):
    prompt = [5, 17, 99, 3, 250, 8, 41, 1000, 12]
    llm = hybrid_llm(falcon_dir)
    kv = llm.engine.kv
    assert isinstance(kv, KVCacheCoordinator)
    # every layer twice: its attention (entries 0-3), then its mixer (entries 4-7)
    assert [g.layers for g in kv.groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    kinds = [type(s) for s in llm.engine.runner.model.cache_specs()]
    assert kinds == [FullAttention] * 4 + [RecurrentState] * 4
    (tokens, logprobs), = tokenmill_greedy(llm, [prompt], STEPS)  # fmt: skip
    (hf_tokens, hf_logprobs), = hf_greedy(falcon_dir, [prompt], STEPS)  # fmt: skip
    assert tokens == hf_tokens
    torch.testing.assert_close(logprobs, hf_logprobs, atol=ATOL, rtol=0)


def test_batch_of_12_under_preemption(falcon_dir, hf_falcon):
    prompts = random_prompts(12, seed=3)
    llm = hybrid_llm(falcon_dir, num_kv_blocks=40, ssm_state_cache_size=5)
    results = tokenmill_greedy(llm, prompts, STEPS)
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.slots.num_free == kv.slots.num_slots == 5 and kv.num_free_blocks == 40
    assert_matches_hf(hf_falcon, prompts, results, STEPS, ATOL)


def test_chunked_prefill(falcon_dir, hf_falcon):
    prompts = [
        random_prompts(1, seed=11, longest=100)[0] + list(range(5, 70)),
        *random_prompts(3, 12),
    ]
    llm = hybrid_llm(falcon_dir, max_model_len=192, max_num_batched_tokens=16, max_num_seqs=4)
    assert_matches_hf(hf_falcon, prompts, tokenmill_greedy(llm, prompts, STEPS), STEPS, ATOL)


@pytest.mark.slow
def test_mixer_without_its_norm(tmp_path, smollm2_hf_tokenizer):
    """``mamba_rms_norm=False``: the scan output is only gated, y * silu(z)."""
    from transformers import AutoModelForCausalLM

    path = make_falcon_h1(tmp_path / "plain", smollm2_hf_tokenizer, seed=1, mamba_rms_norm=False)
    prompts = random_prompts(2, seed=13)
    results = tokenmill_greedy(hybrid_llm(path), prompts, STEPS)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(hf, prompts, results, STEPS, ATOL)
