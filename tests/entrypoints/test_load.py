"""Bounded load: 64 concurrent streaming clients. Every answer is complete and equal to the
non-streamed one, requests really batch (more than one running at once), and every KV
block is back in the pool afterwards. The ``slow`` variant runs on the default SmolLM2."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from _serving_helpers import all_blocks_free, wait_for
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import LLM
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

NUM_CLIENTS = 64
NUM_PROMPTS = 8
MAX_TOKENS = 24


def _running(metrics_text: str) -> float:
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "tokenmill:num_requests_running":
            return family.samples[0].value
    raise AssertionError("no tokenmill:num_requests_running")


async def _load(srv: OpenAIServer, model: str, max_tokens: int = MAX_TOKENS) -> float:
    """Run the load; return the most requests /metrics ever showed running at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    prompts = [f"Write about topic number {i}" for i in range(NUM_PROMPTS)]
    common = dict(
        model=model, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )

    def messages(i: int) -> list[dict]:
        return [{"role": "user", "content": prompts[i]}]

    expected = [
        await client.chat.completions.create(messages=messages(i), **common)
        for i in range(NUM_PROMPTS)
    ]

    async def one(k: int) -> tuple[int, str, list[str], object]:
        i = k % NUM_PROMPTS
        stream = await client.chat.completions.create(
            messages=messages(i), stream=True, stream_options={"include_usage": True}, **common
        )
        text, reasons, usage = [], [], None
        async for chunk in stream:
            for c in chunk.choices:
                text.append(c.delta.content or "")
                if c.finish_reason:
                    reasons.append(c.finish_reason)
            usage = chunk.usage or usage
        return i, "".join(text), reasons, usage

    peak = 0.0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
            deadline = time.monotonic() + 300
            while not done.is_set() and time.monotonic() < deadline:
                peak = max(peak, _running((await http.get("/metrics")).text))
                await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(k) for k in range(NUM_CLIENTS))), timeout=300
        )
    finally:
        done.set()
        await watcher
    for i, text, reasons, usage in results:
        ref = expected[i]
        assert text == ref.choices[0].message.content, f"prompt {i}"
        assert reasons == ["length"]
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == ref.usage.prompt_tokens
    await client.close()
    return peak


def _check_load(srv: OpenAIServer, model: str, max_tokens: int = MAX_TOKENS) -> None:
    kv = srv.state.llm.engine.kv
    free_before = kv.num_free_blocks
    stats = srv.state.llm.stats
    completed = stats.completed
    peak = asyncio.run(_load(srv, model, max_tokens))
    assert peak > 1, "requests never ran together"
    wait_for(lambda: all_blocks_free(srv), what="all blocks back after the load")
    assert kv.num_free_blocks == free_before
    assert stats.completed == completed + NUM_CLIENTS + NUM_PROMPTS
    assert stats.refused == 0 and stats.failed == 0


def test_64_concurrent_streams_tiny(server):
    _check_load(server, "tiny")


@pytest.mark.slow
def test_64_concurrent_streams_default_model():
    llm = LLM()
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    try:
        _check_load(srv, srv.state.model_name, max_tokens=32)
    finally:
        srv.close(timeout=60)
        llm.close()
