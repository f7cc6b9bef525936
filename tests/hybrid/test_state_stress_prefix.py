"""The random hybrid run of ``test_state_stress.py`` with prefix hits: prompts share a
few prefixes, so requests resume from recurrent-state snapshots, under a snapshot pool of
four rows (evictions) as well as small KV and state pools (preemption, which comes back
through the snapshots too). Blocks, state slots and snapshot rows are checked after every
step (``check_kv_integrity``); every request that is not aborted gets exactly the tokens
it gets alone without the cache; at the end every block and slot is free and every
snapshot row free or committed."""

from __future__ import annotations

import random

import pytest
from hybrid_checkpoints import VOCAB, hybrid_llm, make_qwen3_5

from tokenmill.inputs import TokensPrompt
from tokenmill.kv_cache.snapshots import row_bytes
from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def stress_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_prefix"), smollm2_hf_tokenizer, seed=6)


def _alone(llm, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A shared prefix cut at one of a few points (the end of an earlier prompt, or past a
    64-token snapshot), then often nothing, else up to 8 fresh tokens."""
    prefix = rng.choice(prefixes)[: rng.choice([3, 30, 70, 90]) + rng.randrange(2)]
    extra = 0 if rng.random() < 0.4 else rng.randrange(1, 9)
    return prefix + [rng.randrange(3, VOCAB) for _ in range(extra)]


def test_random_run_with_prefix_hits(stress_dir):
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(90)] for _ in range(3)]
    probe = hybrid_llm(stress_dir, max_model_len=112, recurrent_snapshot_pool_bytes=0)
    budget = 6 * row_bytes(probe.engine.runner.model.cache_specs(), 4)
    llm = hybrid_llm(
        stress_dir, max_model_len=112, num_kv_blocks=40, ssm_state_cache_size=3,
        max_num_batched_tokens=24, max_num_seqs=4, recurrent_snapshot_pool_bytes=budget,
    )  # fmt: skip
    engine = llm.engine
    requests: dict[str, tuple[list[int], int]] = {}
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()
    steps = 0
    while steps < 600 and (len(requests) < 24 or engine.has_unfinished()):
        if len(requests) < 24 and rng.random() < 0.3:
            prompt, n = _prompt(rng, prefixes), rng.randrange(1, 16)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            requests[engine.add_request(prompt, params)] = (prompt, n)
        live = [r for r in requests if r not in done and r not in aborted]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    assert not engine.has_unfinished(), "the run did not drain in 600 steps"
    kv = engine.kv
    pool = kv.snapshots
    assert engine.scheduler.num_preemptions > 0 and aborted
    assert pool.stats.restores > 3 and pool.stats.evictions > 0
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    assert pool.num_committed + len(pool._free) == pool.num_rows  # nothing left reserved
    reference = hybrid_llm(stress_dir, max_model_len=112, enable_prefix_caching=False)
    for request_id, tokens in done.items():
        prompt, n = requests[request_id]
        assert tokens == _alone(reference, prompt, n), request_id
