"""Data parallelism on one local Ray cluster (shared by the module: it starts slowly).

Two small replicas: concurrent requests give the one-engine greedy tokens; a multi-turn
workload reuses more of the prefix cache with cache-aware routing than round-robin; a
replica killed mid-load fails only requests that had output, the others are retried,
and it comes back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from scale_out_models import save_family

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError

ray = pytest.importorskip("ray")  # the test extra installs it (make setup)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_hf_tokenizer):
    return save_family("llama_tied", tmp_path_factory.mktemp("dp") / "m", smollm2_hf_tokenizer)


def _router(model_dir, **options):
    from tokenmill.distributed.router import DataParallelRouter

    config = EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                          data_parallel_size=2, **options)  # fmt: skip
    return DataParallelRouter(config)


async def _generate(
    router, prompt: list[int], params=GREEDY, options=None
) -> list[int] | BaseException:
    try:
        stream = await router.add_request(prompt, params, options=options)
        last = None
        async for out in stream:
            last = out
        return last.outputs[0].token_ids
    except EngineDeadError as exc:
        return exc


def _prompts(n: int) -> list[list[int]]:
    return [[5 + i % 7, 6 + i % 11, 7, 8 + i] * (1 + i % 5) for i in range(n)]


def _reference(model_dir, prompts, params=GREEDY) -> list[list[int]]:
    with LLM(str(model_dir), dtype="float32", num_kv_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_dp2_concurrent_requests_equal_dp1(cluster, model_dir):
    prompts = _prompts(64)
    router = _router(model_dir)
    try:
        assert router.health() == {"status": "ok", "replicas": 2, "replicas_up": 2}

        async def run():
            return await asyncio.gather(*(_generate(router, p) for p in prompts))

        got = asyncio.run(run())
        assert sorted(router.router_stats.routed) == [0, 1]  # both replicas served
        time.sleep(0.3)  # the monitor merges the replicas' counters
        assert router.stats.completed == 64
    finally:
        router.shutdown()
    assert got == _reference(model_dir, prompts)


def _multi_turn_hit_rate(model_dir, routing: str) -> tuple[float, float]:
    """(prefix tokens the replicas reused / prompt tokens, the router's expectation)."""
    router = _router(model_dir, data_parallel_routing=routing)
    # 3 conversations: round-robin sends a conversation's turns to alternate replicas
    histories = [[10 + c, 20 + c, 30 + c] * 6 for c in range(3)]
    try:
        for turn in range(5):

            async def one_turn(prompts):
                return await asyncio.gather(*(_generate(router, p) for p in prompts))

            outs = asyncio.run(one_turn(histories))
            histories = [h + out + [40 + turn, 41, 42] for h, out in zip(histories, outs)]
            time.sleep(0.25)  # the replicas' block events reach the router
        metrics = router.engine.prefix_cache_metrics()
        reused = metrics["prefix_cache_reused_tokens"] / router.stats.prompt_tokens
        return reused, router.router_stats.hit_rate
    finally:
        router.shutdown()


def test_cache_aware_routing_beats_round_robin(cluster, model_dir):
    aware, expected = _multi_turn_hit_rate(model_dir, "cache_aware")
    round_robin, _ = _multi_turn_hit_rate(model_dir, "round_robin")
    assert aware > round_robin + 0.2, (aware, round_robin)
    assert abs(expected - aware) < 0.15  # the router's view matches what the replicas did


def test_a_killed_replica_fails_started_requests_retries_the_rest_and_returns(cluster, model_dir):
    long = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = _prompts(12)
    router = _router(model_dir, max_num_seqs=2)  # most requests wait: no output yet
    victim = router.replicas[0]
    health: list[dict] = []
    try:

        async def run():
            tasks = [asyncio.ensure_future(_generate(router, p, long)) for p in prompts]
            while not router.router_stats.routed or victim.stats.generation_tokens == 0:
                await asyncio.sleep(0.02)
                if any(t.done() for t in tasks):
                    break
            os.kill(victim.process.pid, signal.SIGKILL)
            while router.health()["status"] == "ok":  # until the router notices
                await asyncio.sleep(0.02)
            health.append(router.health())
            return await asyncio.gather(*tasks)

        got = asyncio.run(asyncio.wait_for(run(), timeout=120))
        stats = router.router_stats
        deadline = time.monotonic() + 90
        while router.health()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health == [{"status": "degraded", "replicas": 2, "replicas_up": 1}]
        assert router.health()["status"] == "ok" and stats.restarts == 1
        assert router.replicas[0] is not victim
    finally:
        router.shutdown()
    ref = _reference(model_dir, prompts, long)
    failed = [g for g in got if isinstance(g, BaseException)]
    assert all("replica 0" in str(e) and "died" in str(e) for e in failed)
    assert stats.retried >= 1 and len(failed) <= 2  # at most max_num_seqs had output
    assert all(g == r for g, r in zip(got, ref) if not isinstance(g, BaseException))


def test_dp2_takes_images(cluster, tmp_path):
    """Media under data parallelism: replica 0's processor (sent in ``Ready``) makes the
    placeholder runs and pixel tensors in the driver, the chosen replica encodes them. Six
    image prompts over both replicas give the one-engine greedy tokens, and the replicas'
    encoder counters are summed; routing keys blocks by their media."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "multimodal"))
    from qwen_vl_checkpoints import IMAGE_PAD, VISION_END, VISION_START, make_qwen_vl, random_image

    from tokenmill.distributed.router import DataParallelRouter
    from tokenmill.engine.request import RequestOptions
    from tokenmill.multimodal.options import MediaOptions

    path = make_qwen_vl(tmp_path / "vl", seed=4)
    opts = dict(dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=512)
    ids = [VISION_START, IMAGE_PAD, VISION_END, *b"What is this?"]
    images = [random_image(56 + 28 * (i % 3), 56 + 28 * (i // 3), i) for i in range(6)]
    with LLM(str(path), **opts) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": {"image": im}} for im in images],
            GREEDY, use_tqdm=False,
        )  # fmt: skip
    router = DataParallelRouter(EngineConfig(model=str(path), data_parallel_size=2, **opts))
    try:
        processor = router.engine.mm_processor
        requests = [processor.process(ids, {"image": im}, MediaOptions()) for im in images]

        async def run():
            return await asyncio.gather(*(
                _generate(router, pids, options=RequestOptions(multimodal=mm))
                for pids, mm in requests
            ))  # fmt: skip

        got = asyncio.run(run())
        assert sorted(set(router.router_stats.routed)) == [0, 1]  # both replicas encoded
        time.sleep(0.3)  # the replicas' snapshots and block events reach the router
        assert router.engine.encoder_metrics()["mm_encoder_runs"] == len(images)
        # The router keys blocks by the media they cover, as the replicas do: the same
        # image again matches its whole prompt, another image of that size nothing.
        stats = router.router_stats
        for image, expected in (
            (images[0], 4 * (len(requests[0][0]) // 4)),
            (random_image(56, 56, 99), 0),
        ):
            pids, mm = processor.process(ids, {"image": image}, MediaOptions())
            before = stats.matched_tokens
            asyncio.run(_generate(router, pids, options=RequestOptions(multimodal=mm)))
            assert stats.matched_tokens - before == expected
    finally:
        router.shutdown()
    assert got == [o.outputs[0].token_ids for o in outs]
