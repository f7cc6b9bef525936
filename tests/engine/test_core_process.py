"""EngineCoreClient: the engine in a child process behind AsyncLLM's interface.

Same outputs as in process, bad requests refused with the engine's error, aborts that
free blocks, calls, a clean shutdown, and crashes in the child that fail the requests.
The functions sent with ``call`` live at module level: they are pickled by name.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time

import pytest

from tokenmill import RequestOutputKind, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.core_process import EngineCoreClient
from tokenmill.engine.engine import LLMEngine
from tokenmill.errors import (
    DrainingError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    QueueTimeoutError,
)


def _config(path, **overrides) -> EngineConfig:
    options = dict(
        model=str(path), dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=4
    )
    options.update(overrides)
    return EngineConfig(**options)


def _params(kind: RequestOutputKind = RequestOutputKind.DELTA, **kw) -> SamplingParams:
    kw = {"max_tokens": 8, **kw}
    return SamplingParams(temperature=0, ignore_eos=True, output_kind=kind, **kw)


# -- run in the engine process (pickled by reference) -------------------------------------
def _slow_steps(engine: LLMEngine, seconds: float) -> None:
    step = type(engine).step

    def slow():
        time.sleep(seconds)
        return step(engine)

    engine.step = slow  # type: ignore[method-assign]


def _plain_steps(engine: LLMEngine) -> None:
    engine.__dict__.pop("step", None)


def _raise(*_: object) -> None:
    raise RuntimeError("boom in the engine")


def _break_steps(engine: LLMEngine) -> None:
    engine.step = _raise  # type: ignore[method-assign]


def _kill_on_step(engine: LLMEngine) -> None:
    engine.step = functools.partial(os._exit, 3)  # type: ignore[method-assign]


def _sleep(engine: LLMEngine, seconds: float) -> None:
    time.sleep(seconds)


def _free_blocks(engine: LLMEngine) -> tuple[int, int]:
    return engine.kv.num_free_blocks, engine.kv.num_blocks


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    client = EngineCoreClient(_config(tiny_llama_dir))
    yield client
    client.shutdown()
    assert client.process.exitcode == 0  # stopped, not killed


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_outputs_match_in_process(core, tiny_llm):
    prompts = [f"prompt number {i}" for i in range(3)]
    offline = [
        o.outputs[0].text for o in tiny_llm.generate(prompts, _params(RequestOutputKind.FINAL_ONLY))
    ]

    async def run(prompt: str, kind: RequestOutputKind) -> list:
        return [out async for out in core.generate(prompt, _params(kind))]

    async def main():
        return await asyncio.gather(*(run(p, k) for p in prompts for k in RequestOutputKind))

    results = asyncio.run(main())
    for i, text in enumerate(offline):
        cumulative, delta, final = results[3 * i : 3 * i + 3]
        assert len(final) == 1 and final[0].outputs[0].text == text
        assert "".join(o.outputs[0].text for o in delta) == text and len(delta) == 8
        assert cumulative[-1].outputs[0].text == text
    _wait(lambda: core.num_live == 0)
    assert core.num_queued == 0
    stats = core.stats  # the child's counters, mirrored
    assert stats.completed >= 9 and stats.generation_tokens >= 72
    assert stats.time_to_first_token.count >= 9 and stats.num_running == 0


def test_bad_request_is_the_engines_value_error(core):
    async def main():
        with pytest.raises(InvalidRequestError, match="vocabulary|token ids"):
            await core.add_request([10**8], _params())

    asyncio.run(main())
    assert core.num_live == 0 and core.num_queued == 0


def test_abort_frees_blocks(core):
    async def main():
        await core.call(functools.partial(_slow_steps, seconds=0.02))
        stream = await core.add_request(list(range(5, 40)), _params(max_tokens=200))
        first = await stream.__anext__()
        assert not first.finished
        stream.close()  # the client went away
        await core.call(_plain_steps)

    asyncio.run(main())
    _wait(lambda: core.num_live == 0)
    free, total = asyncio.run(core.call(_free_blocks))
    assert free == total and core.engine.kv.num_free_blocks == total
    assert core.stats.cancelled >= 1


def test_call_needs_a_picklable_function(core):
    with pytest.raises(TypeError, match="picklable"):
        asyncio.run(core.call(lambda engine: 1))
    assert asyncio.run(core.reset_prefix_cache()) >= 0


def test_load_error_is_raised(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        EngineCoreClient(_config(tiny_llama_dir, max_model_len=10**6))


@pytest.mark.parametrize(
    "breaker, message",
    [
        (_break_steps, "the engine failed: RuntimeError\\('boom"),
        (_kill_on_step, "died \\(exit code 3\\)"),
    ],
)
def test_a_crash_in_the_engine_fails_requests(tiny_llama_dir, breaker, message):
    client = EngineCoreClient(_config(tiny_llama_dir))
    try:

        async def main():
            await client.call(breaker)
            with pytest.raises(EngineDeadError, match=message):  # accepted or not yet
                stream = await client.add_request([5, 6, 7], _params())
                async for _ in stream:
                    pass

        asyncio.run(asyncio.wait_for(main(), 30))
        _wait(lambda: not client.is_ready)
        assert client.num_live == 0
        with pytest.raises(EngineDeadError):
            asyncio.run(client.add_request([5, 6, 7], _params()))
    finally:
        client.shutdown(timeout=10)
    assert client.process.exitcode in (1, 3) and not client.process.is_alive()


def test_admission_queue_full_and_queue_timeout(tiny_llama_dir):
    """The server side refuses past max_queued_requests; the engine side drops a request
    that waited past queue_timeout; the counts follow the child's."""
    client = EngineCoreClient(
        _config(tiny_llama_dir, max_num_seqs=1), max_queued_requests=1, queue_timeout=0.5
    )
    try:

        async def main():
            await client.call(functools.partial(_slow_steps, seconds=0.02))
            running = await client.add_request([5, 6, 7], _params(max_tokens=100))
            await running.__anext__()  # A runs (max_num_seqs=1)
            waiting = await client.add_request([8, 9], _params(max_tokens=2))
            assert client.num_queued == 1
            with pytest.raises(QueueFullError):
                await client.add_request([8, 9], _params(max_tokens=2))
            with pytest.raises(QueueTimeoutError):
                async for _ in waiting:
                    pass
            running.close()
            client.stop_accepting()
            with pytest.raises(DrainingError):
                await client.add_request([8, 9], _params(max_tokens=2))
            assert await client.drain(timeout=10)

        asyncio.run(asyncio.wait_for(main(), 60))
        assert client.num_live == 0 and client.num_queued == 0
        stats = client.stats
        assert stats.refused_queue_full == 1 and stats.refused_draining == 1
        _wait(lambda: client.stats.refused_queue_timeout == 1)
    finally:
        client.shutdown()
    assert client.process.exitcode == 0


def test_a_hung_engine_is_killed_once_with_its_stacks(tiny_llama_dir, capfd):
    """Two threads stop a process whose engine hangs in a step (the server's lifespan and
    its ``close()`` both do): neither raises, the hung thread's stack is on stderr, and the
    process is killed."""
    client = EngineCoreClient(_config(tiny_llama_dir))

    async def hang():
        asyncio.ensure_future(client.call(functools.partial(_sleep, seconds=120)))
        await asyncio.sleep(0.5)  # sent: the engine thread sleeps in it

    asyncio.run(hang())
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            client.shutdown(timeout=2)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=stop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert not client.process.is_alive() and client.process.exitcode == -signal.SIGKILL
    assert "in _sleep" in capfd.readouterr().err  # faulthandler's dump of the engine thread
