"""Helpers of the server tests (a unique module name: tests/ folders share sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenmill import LLM
from tokenmill.entrypoints.openai.launcher import OpenAIServer

MODEL = "tiny"


def tiny_engine_llm(path, **overrides) -> LLM:
    options = dict(
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=1024,
        block_size=4,
        served_model_name=MODEL,
    )
    options.update(overrides)
    return LLM(str(path), **options)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll until condition() holds (bounded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(0.01)


def all_blocks_free(srv: OpenAIServer) -> bool:
    kv = srv.state.llm.engine.kv
    return kv.num_free_blocks == kv.num_blocks and srv.state.llm.num_live == 0


def chat_body(content: str = "Hello there", **fields) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(fields)
    return body


def slow_steps(srv: OpenAIServer, seconds: float) -> None:
    """Make every engine step take at least `seconds` (timing-dependent tests)."""
    engine = srv.state.llm.engine
    step = type(engine).step

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return step(engine, *args, **kwargs)

    engine.step = slow
