"""LFM2 (short convolutions + attention) against transformers on random weights: one
prompt, a batch of 12 under preemption, chunked prefill (conv windows carried across
chunks)."""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import (
    assert_matches_hf,
    hf_greedy,
    hybrid_llm,
    make_lfm2,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill.kv_cache import KVCacheCoordinator
from tokenmill.kv_cache.spec import FullAttention, RecurrentState

STEPS = 32
ATOL = 2e-4


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_lfm2(tmp_path_factory.mktemp("lfm2"), smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def hf_lfm2(lfm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float32).eval()


def test_single_prompt_equals_transformers_generate(lfm2_dir):
    prompt = [5, 17, 99, 3, 250, 8, 41, 1000, 12]
    llm = hybrid_llm(lfm2_dir)
    kv = llm.engine.kv
    assert isinstance(kv, KVCacheCoordinator)
    assert [g.layers for g in kv.groups] == [(2, 5), (0, 1, 3, 4)]
    specs = llm.engine.runner.model.cache_specs()
    assert specs[0] == RecurrentState((64, 2), torch.float32)
    assert isinstance(specs[2], FullAttention)
    (tokens, logprobs), = tokenmill_greedy(llm, [prompt], STEPS)  # fmt: skip
    (hf_tokens, hf_logprobs), = hf_greedy(lfm2_dir, [prompt], STEPS)  # fmt: skip
    assert tokens == hf_tokens
    torch.testing.assert_close(logprobs, hf_logprobs, atol=ATOL, rtol=0)


def test_batch_of_12_under_preemption(lfm2_dir, hf_lfm2):
    prompts = random_prompts(12, seed=2)
    llm = hybrid_llm(lfm2_dir, num_kv_blocks=40, ssm_state_cache_size=6)
    results = tokenmill_greedy(llm, prompts, STEPS)
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.slots.num_free == kv.slots.num_slots == 6 and kv.num_free_blocks == 40
    assert_matches_hf(hf_lfm2, prompts, results, STEPS, ATOL)


def test_chunked_prefill(lfm2_dir, hf_lfm2):
    """16-token steps: every prompt's conv windows carry from chunk to chunk."""
    prompts = [
        random_prompts(1, seed=9, longest=100)[0] + list(range(5, 70)),
        *random_prompts(3, 4),
    ]
    llm = hybrid_llm(lfm2_dir, max_model_len=192, max_num_batched_tokens=16, max_num_seqs=4)
    assert_matches_hf(hf_lfm2, prompts, tokenmill_greedy(llm, prompts, STEPS), STEPS, ATOL)
