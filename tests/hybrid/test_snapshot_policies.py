"""The snapshot pool's policies through the engine (a Qwen3.5 checkpoint, blocks of 16):
the fallback to the longest prefix with a snapshot, LRU eviction under a tiny byte
budget, ``reuse_context`` and ``cache_generated_tokens``, a budget of 0, bad options."""

from __future__ import annotations

import random

import pytest
from hybrid_checkpoints import VOCAB, hybrid_llm, make_qwen3_5

from tokenmill.config import EngineConfig
from tokenmill.inputs import TokensPrompt
from tokenmill.kv_cache.snapshots import row_bytes
from tokenmill.sampling_params import SamplingParams

OPTIONS = {"max_model_len": 256, "num_kv_blocks": 128, "block_size": 16}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_snap"), smollm2_hf_tokenizer, seed=5)


@pytest.fixture(scope="module")
def reference(qwen_dir):
    return hybrid_llm(qwen_dir, enable_prefix_caching=False, **OPTIONS)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _generate(llm, prompt: list[int], n: int = 4, **options) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    item = TokensPrompt(prompt_token_ids=prompt, **options)  # type: ignore[typeddict-item]
    out = llm.generate([item], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _hits(llm) -> tuple[int, int]:
    m = llm.get_prefix_cache_metrics()
    return m["recurrent_snapshot_restores"], m["recurrent_snapshot_hit_tokens"]


def _row_bytes(llm) -> int:
    return row_bytes(llm.engine.runner.model.cache_specs(), OPTIONS["block_size"])


def test_falls_back_to_the_longest_prefix_with_a_snapshot(qwen_dir, reference):
    """B shares 146 tokens (9 cached blocks) with A, whose snapshots are at 64, 128 and
    149 (its last prompt token but one): no snapshot at 144, so B resumes at 128 and gives the blocks
    past it back."""
    prompt = _tokens(150, seed=1)
    llm = hybrid_llm(qwen_dir, **OPTIONS)
    _generate(llm, prompt)
    second = prompt[:146] + _tokens(6, seed=2)
    assert _generate(llm, second) == _generate(reference, second)
    assert _hits(llm) == (1, 128)
    assert llm.get_prefix_cache_metrics()["prefix_cache_reused_tokens"] == 128


def test_lru_eviction_under_a_tiny_budget(qwen_dir, reference):
    llm = hybrid_llm(qwen_dir, **OPTIONS, context_cache_config={"recurrent_snapshot_pool_bytes": 0})
    budget = 3 * _row_bytes(llm)  # three rows
    llm = hybrid_llm(qwen_dir, **OPTIONS,
                     context_cache_config={"recurrent_snapshot_pool_bytes": budget + 7})  # fmt: skip
    pool = llm.engine.kv.snapshots
    assert pool.num_rows == 3
    prompt = _tokens(150, seed=3)
    _generate(llm, prompt)  # rows: 64, 128, 149
    assert pool.num_committed == 3 and pool.stats.evictions == 0
    second = prompt[:140] + _tokens(10, seed=4)  # resumes at 128 (now the most recent)...
    assert _generate(llm, second) == _generate(reference, second)
    assert _hits(llm) == (1, 128)
    assert pool.stats.evictions == 1  # ... and its own end (149) evicted 64, the oldest
    _generate(llm, _tokens(20, seed=5))  # evicts 149 of the first prompt, not 128
    assert pool.stats.evictions == 2
    third = prompt + _tokens(5, seed=6)  # would resume at 149: falls back to 128
    assert _generate(llm, third) == _generate(reference, third)
    assert _hits(llm) == (2, 256)
    fourth = prompt[:70] + _tokens(5, seed=7)  # 64 was evicted: nothing to resume
    assert _generate(llm, fourth) == _generate(reference, fourth)
    assert _hits(llm) == (2, 256)
    assert llm.get_prefix_cache_metrics()["recurrent_snapshot_bytes"] == 3 * _row_bytes(llm)


def test_reuse_context_false_reads_nothing_but_saves(qwen_dir, reference):
    prompt = _tokens(40, seed=8)
    llm = hybrid_llm(qwen_dir, **OPTIONS)
    _generate(llm, prompt)
    longer = prompt + _tokens(5, seed=9)
    assert _generate(llm, longer, reuse_context=False) == _generate(reference, longer)
    assert _hits(llm) == (0, 0)
    assert _generate(llm, longer + [7]) == _generate(reference, longer + [7])
    assert _hits(llm) == (1, 44)  # the snapshot the opted-out request left


@pytest.mark.parametrize("cache_generated, hit", [(True, 64), (False, 59)])
def test_cache_generated_tokens(qwen_dir, reference, cache_generated, hit):
    """A 60-token prompt decodes past 64: that snapshot holds generated tokens, kept
    only when they may be cached; the next turn resumes there or one token before the prompt's end."""
    turn1 = _tokens(60, seed=10)
    llm = hybrid_llm(qwen_dir, **OPTIONS)
    answer = _generate(llm, turn1, n=10, cache_generated_tokens=cache_generated)
    turn2 = turn1 + answer + _tokens(8, seed=11)
    assert _generate(llm, turn2) == _generate(reference, turn2)
    assert _hits(llm) == (1, hit)


def test_a_budget_of_zero_reuses_nothing(qwen_dir, reference):
    llm = hybrid_llm(qwen_dir, **OPTIONS, recurrent_snapshot_pool_bytes=0)
    assert llm.engine.kv.snapshots is None and not llm.engine.kv.enable_prefix_caching
    prompt = _tokens(70, seed=12)
    _generate(llm, prompt)
    assert _generate(llm, prompt + [9]) == _generate(reference, prompt + [9])
    metrics = llm.get_prefix_cache_metrics()
    assert (
        metrics["prefix_cache_reused_tokens"] == 0 and "recurrent_snapshot_restores" not in metrics
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"context_cache_config": {"recurrent_snapshot_pool_bytes": -1}}, "must be an integer >= 0"),
        ({"recurrent_snapshot_pool_bytes": -5}, "must be an integer >= 0 .*got -5"),
        ({"context_cache_config": {"recurrent_snapshot_pool_bytes": 1.5}}, "got 1.5"),
        ({"context_cache_config": {"snapshot_bytes": 1}}, "unknown keys \\['snapshot_bytes'\\]"),
        (
            {"context_cache_config": {"recurrent_snapshot_pool_bytes": 1},
             "recurrent_snapshot_pool_bytes": 1},
            "given twice",
        ),
    ],
)  # fmt: skip
def test_bad_options_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_server_flag_sets_the_budget():
    import argparse

    from tokenmill.entrypoints.args import add_engine_flags

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--recurrent-snapshot-pool-bytes", "64MiB"])
    assert args.recurrent_snapshot_pool_bytes == 64 << 20
    config = EngineConfig(recurrent_snapshot_pool_bytes=args.recurrent_snapshot_pool_bytes)
    assert config.context_cache.recurrent_snapshot_pool_bytes == 64 << 20


def test_snapshot_metrics_reach_prometheus(qwen_dir):
    from prometheus_client import generate_latest

    from tokenmill.metrics.prometheus import make_registry

    llm = hybrid_llm(qwen_dir, **OPTIONS)
    prompt = _tokens(20, seed=13)
    _generate(llm, prompt)
    _generate(llm, prompt + [5])
    engine = llm.engine
    registry = make_registry(lambda: engine.stats, lambda: engine.kv.usage, "m",
                             engine.prefix_cache_metrics)  # fmt: skip
    text = generate_latest(registry).decode()
    assert 'tokenmill:recurrent_snapshot_restores_total{model_name="m"} 1.0' in text
    assert 'tokenmill:recurrent_snapshot_hit_tokens_total{model_name="m"} 19.0' in text
    assert "tokenmill:recurrent_snapshot_bytes{" in text
