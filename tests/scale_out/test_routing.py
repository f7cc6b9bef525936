"""Routing policies and prefix-cache events, without Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.config import EngineConfig
from tokenmill.distributed.routing import (
    BlockEvents,
    CacheAware,
    PrefixIndex,
    RoundRobin,
    prompt_chain,
)
from tokenmill.engine.request import RequestOptions

BS = 4


def _key(salt: str | None) -> bytes:
    return RequestOptions(cache_salt=salt).block_key()


def _index(tokens: list[int], salt: str | None = None) -> PrefixIndex:
    index = PrefixIndex()
    index.apply(BlockEvents(tuple(prompt_chain(tokens, BS, _key(salt))), ()))
    return index


def test_cache_aware_takes_the_longest_cached_prefix_unless_much_busier():
    history = list(range(40))
    indexes = [_index(history[:8]), _index(history[:32]), PrefixIndex()]
    chain = prompt_chain(history + [99, 98], BS)
    policy = CacheAware(load_weight=4)
    assert policy.choose(chain, BS, [0, 1, 2], indexes, [0, 0, 0]).replica == 1
    assert policy.choose(chain, BS, [0, 1, 2], indexes, [0, 0, 0]).matched_tokens == 32
    # 24 more cached tokens are worth 6 requests in flight at 4 tokens each
    assert policy.choose(chain, BS, [0, 1, 2], indexes, [0, 7, 0]).replica == 0
    assert policy.choose(chain, BS, [0, 2], indexes, [0, 0, 0]).replica == 0  # 1 is down
    # nothing cached anywhere: the least loaded
    assert policy.choose(prompt_chain([7] * 9, BS), BS, [0, 1, 2], indexes,
                         [3, 1, 2]).replica == 1  # fmt: skip


def test_salted_prompts_match_only_their_salt():
    tokens = list(range(16))
    index = _index(tokens, salt="tenant-a")
    assert index.matched_blocks(prompt_chain(tokens, BS, _key("tenant-a"))) == 4
    assert index.matched_blocks(prompt_chain(tokens, BS)) == 0


def test_evicted_blocks_stop_matching_and_round_robin_cycles():
    tokens = list(range(16))
    index = _index(tokens)
    chain = prompt_chain(tokens, BS)
    index.apply(BlockEvents((), (chain[1],)))
    assert index.matched_blocks(chain) == 1
    rr = RoundRobin()
    picks = [rr.choose(chain, BS, [0, 2], [index] * 3, [0, 0, 0]).replica for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_replicas_hash_blocks_as_the_router_does(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams
    from tokenmill.distributed.block_events import block_events

    with LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, block_size=BS,
             max_model_len=64) as llm:  # fmt: skip
        prompt = list(range(10, 30))  # 5 full blocks
        sp = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        events = block_events(llm.engine)
        assert set(prompt_chain(prompt, BS)) <= set(events.added)
        assert events.evicted == ()
        llm.engine.reset_prefix_cache()
        assert set(block_events(llm.engine).evicted) == set(events.added)


def test_data_parallel_without_ray_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "ray" else real(n, *a)
    )
    with pytest.raises(ValueError, match=r"data_parallel_size=2 .* pip install 'tokenmill\[ray\]'"):
        EngineConfig(data_parallel_size=2)
    with pytest.raises(ValueError, match=r"backend='ray' .* pip install 'tokenmill\[ray\]'"):
        EngineConfig(distributed_executor_backend="ray")


def test_import_tokenmill_does_not_import_ray():
    code = ("import sys, tokenmill; from tokenmill import LLM; import tokenmill.distributed.router;"
            " sys.exit('ray' in sys.modules)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_offline_data_parallel_points_to_the_server(tiny_llama_dir):
    from tokenmill import LLM

    with pytest.raises(ValueError, match="tokenmill serve --data-parallel-size"):
        LLM(str(tiny_llama_dir), data_parallel_size=2)
