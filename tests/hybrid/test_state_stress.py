"""A random run of a hybrid model through the engine: arrivals, aborts, chunked prefill and
preemption (small KV and state pools) over a few hundred steps, with the block and slot
bookkeeping checked after every step (``check_kv_integrity``). Every request that is not
aborted gets exactly the tokens it gets alone; at the end every block and slot is free."""

from __future__ import annotations

import random

import pytest
from hybrid_checkpoints import VOCAB, hybrid_llm, make_qwen3_5

from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def stress_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5_stress"), smollm2_hf_tokenizer, seed=4)


def _alone(llm, prompt: list[int], n: int) -> list[int]:
    from tokenmill.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_random_arrivals_aborts_and_preemption(stress_dir):
    rng = random.Random(0)
    llm = hybrid_llm(
        stress_dir, max_model_len=96, num_kv_blocks=24, ssm_state_cache_size=3,
        max_num_batched_tokens=24, max_num_seqs=4,
    )  # fmt: skip
    engine = llm.engine
    requests: dict[str, tuple[list[int], int]] = {}
    done: dict[str, list[int]] = {}
    aborted: set[str] = set()
    steps = 0
    while steps < 400 and (len(requests) < 12 or engine.has_unfinished()):
        if len(requests) < 12 and rng.random() < 0.3:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 50))]
            n = rng.randrange(1, 20)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            requests[engine.add_request(prompt, params)] = (prompt, n)
        live = [r for r in requests if r not in done and r not in aborted]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished and out.request_id not in aborted:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    assert not engine.has_unfinished(), "the run did not drain in 400 steps"
    assert engine.scheduler.num_preemptions > 0 and aborted
    kv = engine.kv
    assert kv.slots.num_free == kv.slots.num_slots and kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    reference = hybrid_llm(stress_dir, max_model_len=96)
    for request_id, tokens in done.items():
        prompt, n = requests[request_id]
        assert tokens == _alone(reference, prompt, n), request_id
