"""Prefix caching, priorities and chunking through the whole engine."""

from __future__ import annotations

import random

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.request import RequestOptions

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory, smollm2_hf_tokenizer):
    from tiny_models import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("long-llama"), smollm2_hf_tokenizer, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    kw = dict(dtype="float32", max_model_len=256, block_size=4, num_kv_blocks=160)
    with (
        LLM(str(tiny_llama_dir), **kw) as cached,
        LLM(str(tiny_llama_dir), enable_prefix_caching=False, **kw) as plain,
    ):
        yield cached, plain


def test_outputs_identical_with_and_without_cache(engines):
    cached, plain = engines
    system = ids(1, 37)
    prompts = [{"prompt_token_ids": system + ids(100 + i, 3 + 5 * i)} for i in range(6)]
    for mix in (prompts, prompts[::-1], prompts[:2] + prompts[:2]):
        a = [o.outputs[0].token_ids for o in cached.generate(mix, GREEDY)]
        b = [o.outputs[0].token_ids for o in plain.generate(mix, GREEDY)]
        assert a == b
    again = cached.generate(prompts[0], GREEDY)[0]
    assert again.num_cached_tokens == 36  # 9 full blocks of the 40-token prompt
    cached.engine.kv.check_integrity()


def test_shared_1000_token_prefix_computes_5x_fewer_tokens(long_llama_dir):
    with LLM(
        str(long_llama_dir), dtype="float32", max_model_len=1100, block_size=16, num_kv_blocks=200
    ) as llm:
        prefix = ids(7, 1000)
        computed = []
        for tail in (ids(8, 20), ids(9, 20)):
            out = llm.generate(
                {"prompt_token_ids": prefix + tail}, SamplingParams(temperature=0, max_tokens=1)
            )[0]
            computed.append(len(out.prompt_token_ids) - out.num_cached_tokens)
        assert computed[0] == 1020
        assert computed[0] >= 5 * computed[1]  # the second request prefills only its tail
        m = llm.get_prefix_cache_metrics()
        assert m["prefix_cache_hits"] == 1 and m["prefix_cache_reused_tokens"] == 992


def test_multi_turn_reuses_generated_tokens_unless_opted_out(engines):
    cached, _ = engines
    cached.reset_prefix_cache()
    turn1 = ids(20, 30)
    out1 = cached.generate(
        {"prompt_token_ids": turn1}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    turn2 = turn1 + out1.outputs[0].token_ids + ids(21, 5)
    out2 = cached.generate({"prompt_token_ids": turn2}, GREEDY)[0]
    assert (
        out2.num_cached_tokens == 40
    )  # prompt and generated tokens: 10 full blocks of 42 computed
    cached.reset_prefix_cache()
    cached.generate(
        {"prompt_token_ids": turn1, "cache_generated_tokens": False},
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    )
    out2 = cached.generate({"prompt_token_ids": turn2}, GREEDY)[0]
    assert out2.num_cached_tokens == 28  # the prompt's 7 full blocks only
    out3 = cached.generate({"prompt_token_ids": turn2, "reuse_context": False}, GREEDY)[0]
    assert out3.num_cached_tokens == 0
    assert out3.outputs[0].token_ids == out2.outputs[0].token_ids


def test_cache_salt_isolates_tenants(engines):
    cached, _ = engines
    p = ids(30, 24)
    cached.generate({"prompt_token_ids": p, "cache_salt": "a"}, GREEDY)
    assert (
        cached.generate({"prompt_token_ids": p, "cache_salt": "b"}, GREEDY)[0].num_cached_tokens
        == 0
    )
    assert (
        cached.generate({"prompt_token_ids": p, "cache_salt": "a"}, GREEDY)[0].num_cached_tokens
        == 20
    )


def test_reset_prefix_cache(engines):
    cached, _ = engines
    p = ids(40, 24)
    cached.generate({"prompt_token_ids": p}, GREEDY)
    assert cached.reset_prefix_cache() > 0
    assert cached.generate({"prompt_token_ids": p}, GREEDY)[0].num_cached_tokens == 0


def test_priority_orders_admission(tiny_llama_dir):
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        max_num_seqs=1,
    ) as llm:
        eng = llm.engine
        for i, prio in enumerate([5, 1, 3]):
            eng.add_request(
                ids(i, 5),
                SamplingParams(temperature=0, max_tokens=2),
                f"r{i}",
                options=RequestOptions(priority=prio),
            )
        finished = []
        while eng.has_unfinished():
            finished += [o.request_id for o in eng.step() if o.finished]
        assert finished == ["r1", "r2", "r0"]


def test_preemption_takes_the_lowest_priority(tiny_llama_dir):
    # 12 blocks of 4 tokens: two 20-token requests growing to 28 tokens can not both fit.
    with LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=48,
        block_size=4,
        num_kv_blocks=12,
        enable_prefix_caching=False,
    ) as llm:
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        eng.add_request(ids(1, 20), params, "low", options=RequestOptions(priority=9))
        eng.add_request(ids(2, 20), params, "high", options=RequestOptions(priority=0))
        order = []
        while eng.has_unfinished():
            order += [o.request_id for o in eng.step() if o.finished]
        assert order[0] == "high"
        assert eng.scheduler.requests == {}
        assert eng.scheduler.num_preemptions >= 1


def test_long_prefill_does_not_stall_running_decodes(long_llama_dir):
    with LLM(
        str(long_llama_dir),
        dtype="float32",
        max_model_len=1100,
        block_size=16,
        num_kv_blocks=200,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=128,
    ) as llm:
        eng = llm.engine
        eng.add_request(
            ids(1, 10), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "chat"
        )
        eng.step()  # chat is now decoding
        eng.add_request(ids(2, 1000), SamplingParams(temperature=0, max_tokens=1), "long")
        steps = 0
        while (
            "long" in eng.scheduler.requests
            and eng.scheduler.requests["long"].num_output_tokens == 0
        ):
            before = eng.scheduler.requests["chat"].num_output_tokens
            out = eng.scheduler.schedule()
            chunk = {s.request.request_id: s.num_new_tokens for s in out.seqs}
            assert chunk.get("long", 0) <= 128
            assert chunk.get("chat") == 1  # the decode runs in every step of the long prefill
            result = eng.runner.collect(eng.runner.launch(out))
            eng.scheduler.update(out, result.tokens)
            assert eng.scheduler.requests["chat"].num_output_tokens == before + 1
            steps += 1
        assert steps >= 1000 // 128
        for rid in ("chat", "long"):
            eng.abort(rid)
        eng.kv.check_integrity()
