"""AsyncLLM: the engine in its own thread; streams per request; admission; abort; drain."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill import RequestOutputKind, SamplingParams
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.errors import DrainingError, InvalidRequestError, QueueFullError


@pytest.fixture
def async_llm(tiny_llm):
    """The shared tiny engine, lent to an AsyncLLM for one test (given back after)."""
    front = AsyncLLM(tiny_llm.engine)
    yield front
    front.shutdown()


def _params(kind: RequestOutputKind, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind, **kw)


def test_kinds_match_offline_and_batch_together(tiny_llm):
    prompts = [f"prompt number {i}" for i in range(4)]
    offline = [
        o.outputs[0].text for o in tiny_llm.generate(prompts, _params(RequestOutputKind.FINAL_ONLY))
    ]
    front = AsyncLLM(tiny_llm.engine)

    async def run(prompt: str, kind: RequestOutputKind) -> list:
        return [out async for out in front.generate(prompt, _params(kind))]

    async def main():
        return await asyncio.gather(*(run(p, k) for p in prompts for k in RequestOutputKind))

    try:
        results = asyncio.run(main())
    finally:
        front.shutdown()
    for i, text in enumerate(offline):
        cumulative, delta, final = results[3 * i : 3 * i + 3]
        assert len(final) == 1 and final[0].outputs[0].text == text
        assert "".join(o.outputs[0].text for o in delta) == text and len(delta) == 8
        assert cumulative[-1].outputs[0].text == text
        assert [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 9))
    assert tiny_llm.engine.stats.inter_token_latency.count > 0


def test_bad_request_raises_value_error(async_llm):
    async def main():
        with pytest.raises(InvalidRequestError, match="vocabulary|token ids"):
            await async_llm.add_request([10**8], _params(RequestOutputKind.DELTA))

    asyncio.run(main())
    assert async_llm.num_live == 0 and async_llm.num_queued == 0


def test_queue_full_and_draining_refuse_at_once(tiny_llm):
    front = AsyncLLM(tiny_llm.engine, max_queued_requests=0)

    async def main():
        with pytest.raises(QueueFullError):
            await front.add_request([5, 6], _params(RequestOutputKind.DELTA))
        front.max_queued_requests = None
        assert await front.drain(timeout=1)
        with pytest.raises(DrainingError):
            await front.add_request([5, 6], _params(RequestOutputKind.DELTA))

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    stats = tiny_llm.engine.stats
    assert stats.refused_queue_full >= 1 and stats.refused_draining >= 1


def test_leaving_the_stream_frees_blocks_within_one_step(async_llm, tiny_llm):
    engine, kv = tiny_llm.engine, tiny_llm.engine.kv
    steps = []

    def counting_step():
        steps.append(kv.num_free_blocks)
        return type(engine).step(engine)

    engine.step = counting_step
    try:

        async def main():
            params = SamplingParams(
                max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            stream = await async_llm.add_request([5, 6, 7], params)
            await anext(stream)
            assert kv.num_free_blocks < kv.num_blocks
            stream.close()
            closed_at = len(steps)
            for _ in range(500):  # bounded: the abort lands before the next step
                if kv.num_free_blocks == kv.num_blocks and async_llm.num_live == 0:
                    return closed_at
                await asyncio.sleep(0.002)
            raise AssertionError("blocks not freed")

        closed_at = asyncio.run(main())
    finally:
        del engine.step
    # at most the step already running when close() was called; none after it
    assert len(steps) - closed_at <= 1


def test_final_only_requests_cost_the_engine_one_output(tiny_llm):
    """The engine honours FINAL_ONLY on the async path too (it used to run every request
    as DELTA and fold the deltas back in the stream: an output per token per request)."""
    front = AsyncLLM(tiny_llm.engine)
    routed: dict[str, int] = {}
    real = front._route

    def count(outputs):
        for out in outputs:
            routed[out.request_id] = routed.get(out.request_id, 0) + 1
        real(outputs)

    front._route = count

    async def main():
        final = [o async for o in front.generate("one", _params(RequestOutputKind.FINAL_ONLY), "f")]
        delta = [o async for o in front.generate("two", _params(RequestOutputKind.DELTA), "d")]
        return final, delta

    try:
        final, delta = asyncio.run(main())
    finally:
        front.shutdown()
    assert routed == {"f": 1, "d": 8}
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 8


def test_offline_runs_beside_a_server_on_the_same_engine(tiny_llm):
    """``LLM.serve`` (or a server on ``llm.engine``) while another thread calls
    ``generate``: the offline run waits for the served requests to finish and holds the
    engine while it runs, so neither driver steps the other's requests or takes their
    outputs (it used to: a served stream stalled, or the offline run found the engine idle
    with its requests unfinished). Both get the tokens each gets alone."""
    import threading

    prompts = [f"shared engine prompt {i}" for i in range(6)]
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    alone = [o.outputs[0].text for o in tiny_llm.generate(prompts, params)]
    front = AsyncLLM(tiny_llm.engine)
    offline: list[list[str]] = []

    def run_offline() -> None:
        for _ in range(3):
            offline.append([o.outputs[0].text for o in tiny_llm.generate(prompts, params)])

    async def served(prompt: str) -> str:
        outs = [out async for out in front.generate(prompt, params)]
        return outs[-1].outputs[0].text

    async def main() -> list[str]:
        thread = threading.Thread(target=run_offline)
        thread.start()
        texts = []
        for _ in range(3):
            texts += await asyncio.gather(*(served(p) for p in prompts))
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        return texts

    try:
        texts = asyncio.run(main())
    finally:
        front.shutdown()
    assert texts == alone * 3
    assert offline == [alone] * 3
    assert not tiny_llm.engine.has_unfinished()
