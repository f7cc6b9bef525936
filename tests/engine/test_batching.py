"""Batch invariance: many requests together (with preemption) == each alone."""

from __future__ import annotations

from tokenmill import LLM, SamplingParams


def test_batch_with_preemption_equals_single_runs(tiny_llama_dir):
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(3 + (i * 5) % 23)] for i in range(18)]
    params = [
        SamplingParams(temperature=0, max_tokens=12 + i % 9, ignore_eos=True) for i in range(18)
    ]
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=80,
        block_size=4,
        max_num_batched_tokens=48,
    ) as small:
        batched = small.generate([{"prompt_token_ids": p} for p in prompts], params)
        engine = small.engine
        assert engine.scheduler.num_preemptions > 0, "cache too big: the test must force preemption"
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engine.kv.check_integrity()
    with LLM(
        str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=4
    ) as big:
        alone = [big.generate({"prompt_token_ids": p}, sp)[0] for p, sp in zip(prompts, params)]
    for b, a in zip(batched, alone):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_seeded_sampling_is_batch_independent(tiny_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    alone = tiny_llm.generate("a seeded prompt", params)[0].outputs[0].token_ids
    mixed = (
        tiny_llm.generate(
            ["noise one", "a seeded prompt", "noise two is longer"],
            [
                SamplingParams(temperature=1.0, max_tokens=10),
                params,
                SamplingParams(temperature=0, max_tokens=5),
            ],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
