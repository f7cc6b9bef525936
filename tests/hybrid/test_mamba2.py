"""Mamba2 (state-space layers only) against transformers on random weights: every layer's
cache is a state slot; one prompt, a batch of 12 under preemption, chunked prefill."""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import (
    assert_matches_hf,
    hf_greedy,
    hybrid_llm,
    make_mamba2,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill.kv_cache import KVCacheCoordinator

STEPS = 32
ATOL = 2e-4


@pytest.fixture(scope="module")
def mamba2_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_mamba2(tmp_path_factory.mktemp("mamba2"), smollm2_hf_tokenizer)


@pytest.fixture(scope="module")
def hf_mamba2(mamba2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mamba2_dir, dtype=torch.float32).eval()


def test_single_prompt_equals_transformers_generate(mamba2_dir):
    prompt = [5, 17, 99, 3, 250, 8, 41, 1000, 12]
    llm = hybrid_llm(mamba2_dir)
    kv = llm.engine.kv
    assert isinstance(kv, KVCacheCoordinator) and [g.kind for g in kv.groups] == ["slots"]
    (tokens, logprobs), = tokenmill_greedy(llm, [prompt], STEPS)  # fmt: skip
    (hf_tokens, hf_logprobs), = hf_greedy(mamba2_dir, [prompt], STEPS)  # fmt: skip
    assert tokens == hf_tokens
    torch.testing.assert_close(logprobs, hf_logprobs, atol=ATOL, rtol=0)
    assert kv.slots.num_free == kv.slots.num_slots


def test_batch_of_12_under_preemption(mamba2_dir, hf_mamba2):
    prompts = random_prompts(12, seed=1)
    llm = hybrid_llm(mamba2_dir, num_kv_blocks=40, ssm_state_cache_size=4)
    results = tokenmill_greedy(llm, prompts, STEPS)
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.slots.num_free == kv.slots.num_slots == 4 and kv.num_free_blocks == 40
    assert_matches_hf(hf_mamba2, prompts, results, STEPS, ATOL)


def test_chunked_prefill(mamba2_dir, hf_mamba2):
    """16-token steps: the SSM states and conv windows carry from chunk to chunk."""
    prompts = [
        random_prompts(1, seed=5, longest=100)[0] + list(range(5, 80)),
        *random_prompts(3, 6),
    ]
    llm = hybrid_llm(mamba2_dir, max_model_len=192, max_num_batched_tokens=16, max_num_seqs=4)
    assert_matches_hf(hf_mamba2, prompts, tokenmill_greedy(llm, prompts, STEPS), STEPS, ATOL)


def test_without_attention_the_ratio_gives_max_num_seqs(mamba2_dir):
    """No full-attention KV to take a ratio of: a slot per running request."""
    llm = hybrid_llm(mamba2_dir, max_num_seqs=6, ssm_full_memory_ratio=0.01)
    assert llm.engine.kv.slots.num_slots == 6


def test_default_time_step_limit_survives_config_json(tmp_path, smollm2_hf_tokenizer):
    """transformers saves Mamba2's default (0, inf) as {"__float__": "Infinity"}: the folder
    loads, and decodes as transformers does."""
    import json

    path = make_mamba2(tmp_path / "inf", smollm2_hf_tokenizer, time_step_limit=(0.0, float("inf")))
    assert "__float__" in (path / "config.json").read_text()
    assert json.loads((path / "config.json").read_text())["time_step_limit"][1] == {
        "__float__": "Infinity"
    }
    prompt = [5, 17, 99, 3, 250, 8]
    (tokens, _), = tokenmill_greedy(hybrid_llm(path), [prompt], 8)  # fmt: skip
    (expected, _), = hf_greedy(path, [prompt], 8)  # fmt: skip
    assert tokens == expected


@pytest.mark.parametrize("gemm", ["auto", "native"])
def test_a_16bit_folder_loads_with_dense_weights(tmp_path, smollm2_hf_tokenizer, monkeypatch, gemm):
    """quantization=auto keeps a bf16 folder's weights 16-bit (or, with the native float32
    kernel asked for, in its tiles) only for models that take a plan: a hybrid keeps dense
    weights and loads (it used to refuse with "quantized weights are not supported")."""
    from tokenmill import native

    if gemm == "native" and native.active_isa() is None:
        pytest.skip("no native kernels here")
    monkeypatch.setenv("TOKENMILL_FP32_GEMM", gemm)
    path = make_mamba2(tmp_path / "m", smollm2_hf_tokenizer)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    prompt = [5, 17, 99, 3]
    dense = tokenmill_greedy(hybrid_llm(path), [prompt], 4)
    from tokenmill import LLM

    dtype = "auto" if gemm == "auto" else "float32"
    llm = LLM(str(path), dtype=dtype, device="cpu", max_model_len=128, num_kv_blocks=64,
              block_size=4)  # fmt: skip
    (tokens, _), = tokenmill_greedy(llm, [prompt], 4)  # fmt: skip
    assert len(tokens) == 4
    if gemm == "native":  # float32 both ways, dense both ways: the same tokens
        assert tokens == dense[0][0]
