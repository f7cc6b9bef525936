"""Qwen3-Next with dense MLPs: Qwen3.5's layers behind per-key-head grouped DeltaNet
projections (regrouped at load), against transformers; mixture-of-experts configs refused."""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import (
    assert_matches_hf,
    hybrid_llm,
    make_qwen3_next_dense,
    random_prompts,
    tokenmill_greedy,
)

from tokenmill.errors import UnsupportedModelError

STEPS = 32


def test_dense_qwen3_next_matches_transformers(tmp_path, smollm2_hf_tokenizer):
    from transformers import AutoModelForCausalLM

    path = make_qwen3_next_dense(tmp_path / "q3n", smollm2_hf_tokenizer)
    prompts = random_prompts(4, seed=21, longest=60)
    llm = hybrid_llm(path, max_num_batched_tokens=16, max_num_seqs=4)  # chunked prefill too
    results = tokenmill_greedy(llm, prompts, STEPS)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_matches_hf(hf, prompts, results, STEPS, 2e-4)


def test_mixture_of_experts_is_refused():
    from tokenmill.models.qwen3_5 import Qwen3NextForCausalLM

    config = {"num_hidden_layers": 4, "num_experts": 8, "decoder_sparse_step": 1,
              "mlp_only_layers": [0]}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"layers \[1, 2, 3\] are mixture-of-experts"):
        Qwen3NextForCausalLM(config, torch.float32)
