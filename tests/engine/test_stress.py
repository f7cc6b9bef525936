"""Randomized stress: arrivals, aborts, stops, preemption and prefix hits on a tiny cache.

KV integrity is checked after every step (check_kv_integrity), every block is
free at the end, and each completed request equals its output on a plain
engine without prefix caching.
"""

from __future__ import annotations

import random

from tokenmill import LLM, SamplingParams


def test_random_traffic_keeps_the_cache_consistent(tiny_llama_dir):
    rng = random.Random(1234)
    prefixes = [[rng.randrange(10, 4000) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    kw = dict(dtype="float32", max_model_len=96, block_size=4)
    with LLM(
        str(tiny_llama_dir),
        num_kv_blocks=40,
        max_num_batched_tokens=64,
        check_kv_integrity=True,
        **kw,
    ) as llm:
        eng = llm.engine
        live: dict[str, tuple[list[int], SamplingParams]] = {}
        done: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        steps = aborted = 0
        next_id = 0
        while steps < 2000:
            if rng.random() < 0.3 and len(live) < 12:
                prompt = rng.choice(prefixes) + [
                    rng.randrange(10, 4000) for _ in range(rng.randrange(1, 12))
                ]
                params = SamplingParams(
                    temperature=0,
                    max_tokens=rng.randrange(1, 20),
                    stop_token_ids=[rng.randrange(10, 4000)] if rng.random() < 0.3 else None,
                )
                rid = f"r{next_id}"
                next_id += 1
                eng.add_request(prompt, params, rid)
                live[rid] = (prompt, params)
            if live and rng.random() < 0.03:
                rid = rng.choice(sorted(live))
                eng.abort(rid)
                del live[rid]
                aborted += 1
            for out in eng.step():
                if out.finished and out.request_id in live:
                    prompt, params = live.pop(out.request_id)
                    done[out.request_id] = (prompt, params, out.outputs[0].token_ids)
            steps += 1
        for rid in list(live):
            eng.abort(rid)
        eng.kv.check_integrity()
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.stats.hits > 0
        assert aborted > 0 and len(done) > 50

    with LLM(str(tiny_llama_dir), num_kv_blocks=400, enable_prefix_caching=False, **kw) as plain:
        items = list(done.values())
        ref = plain.generate(
            [{"prompt_token_ids": p} for p, _, _ in items], [sp for _, sp, _ in items]
        )
        for (_, _, got), want in zip(items, ref):
            assert got == want.outputs[0].token_ids
