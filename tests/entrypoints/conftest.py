"""A real server on 127.0.0.1 (uvicorn in a background thread, a free port) over the tiny
random Llama, shared by the module's tests; clients: the official openai package and httpx."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from _serving_helpers import all_blocks_free, tiny_engine_llm, wait_for

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig


@pytest.fixture(scope="session")
def server(tiny_llama_dir) -> Iterator[OpenAIServer]:
    llm = tiny_engine_llm(tiny_llama_dir)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    yield srv
    srv.close(timeout=30)
    llm.close()


@pytest.fixture(scope="session")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(server):
    openai = pytest.importorskip("openai")
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(autouse=True)
def _no_leaked_blocks(request):
    """After each test on the shared server, every KV block is back in the pool."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        wait_for(lambda: all_blocks_free(srv), what="all KV blocks to be free")
        srv.state.llm.engine.kv.check_integrity()
