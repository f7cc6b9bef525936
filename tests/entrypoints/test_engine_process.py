"""The server with its engine in a child process (``--engine-process on``) against the same
server with the engine in a thread: same greedy outputs (completions and chat, streamed and
not), same 400s, disconnects that free the request, /metrics, and a clean shutdown."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from _serving_helpers import MODEL, chat_body, tiny_engine_llm, wait_for

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

OPTIONS = dict(
    dtype="float32", max_model_len=256, num_kv_blocks=1024, block_size=4, served_model_name=MODEL
)


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    """(thread-mode server, process-mode server) over the same tiny model."""
    llm = tiny_engine_llm(tiny_llama_dir)
    thread = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    config = EngineConfig(model=str(tiny_llama_dir), **OPTIONS)
    process = OpenAIServer(
        config, ServerConfig(port=0, log_level="warning", engine_process="on")
    ).start()
    process.wait_ready()
    yield thread, process
    thread.close(timeout=30)
    llm.close()
    core = process.state.llm
    process.close(timeout=30)
    assert not core.process.is_alive() and core.process.exitcode == 0  # no orphan


def _events(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in response.iter_lines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def _post(srv: OpenAIServer, path: str, body: dict) -> dict | list[dict]:
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        if body.get("stream"):
            with http.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                return _events(r)
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()


def _text(result: dict | list[dict], chat: bool) -> tuple[str, str | None]:
    if isinstance(result, dict):
        choice = result["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    parts, reason = [], None
    for event in result:
        for choice in event.get("choices", []):
            parts.append(
                (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
            )
            reason = choice.get("finish_reason") or reason
    return "".join(parts), reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_same_greedy_outputs(servers, chat, stream):
    thread, process = servers
    for i in range(3):
        if chat:
            path, body = "/v1/chat/completions", chat_body(f"Tell me about {i}", max_tokens=12)
        else:
            path = "/v1/completions"
            body = {
                "model": MODEL,
                "prompt": f"Once upon a time {i}",
                "max_tokens": 12,
                "temperature": 0,
            }
        body["stream"] = stream
        expected = _text(_post(thread, path, body), chat)
        assert _text(_post(process, path, body), chat) == expected
        assert expected[0]


def test_bad_request_is_400(servers):
    bodies = [
        {"model": MODEL, "prompt": [10**7], "max_tokens": 4},
        {"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 10**4},
    ]
    for body in bodies:
        answers = []
        for srv in servers:
            with httpx.Client(base_url=srv.url, timeout=30) as http:
                r = http.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            answers.append(r.json()["error"]["message"])
        assert answers[0] == answers[1]
    assert servers[1].state.llm.num_live == 0 and servers[1].state.ready


def test_disconnect_frees_the_request(servers):
    srv = servers[1]
    body = {
        "model": MODEL,
        "prompt": "A long story",
        "max_tokens": 200,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    before = srv.state.llm.stats.cancelled
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    kv = srv.state.llm.engine.kv
    wait_for(
        lambda: srv.state.llm.num_live == 0 and kv.num_free_blocks == kv.num_blocks,
        what="the aborted request's blocks to be free",
    )
    wait_for(lambda: srv.state.llm.stats.cancelled == before + 1, what="the abort counted")


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^tokenmill:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_metrics_count_the_same(servers):
    body = {
        "model": MODEL,
        "prompt": "Count me",
        "max_tokens": 7,
        "ignore_eos": True,
        "temperature": 0,
    }
    deltas = []
    for srv in servers:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            before = http.get("/metrics").text
            assert http.post("/v1/completions", json=body).status_code == 200
            wait_for(lambda s=srv: s.state.llm.num_live == 0, what="the request to end")
            after = http.get("/metrics").text
        deltas.append(
            {
                name: _metric(after, name) - _metric(before, name)
                for name in (
                    "generation_tokens_total",
                    "prompt_tokens_total",
                    "request_submitted_total",
                    "time_to_first_token_seconds_count",
                )
            }
        )
        assert _metric(after, "num_requests_running") == 0
    assert deltas[0] == deltas[1]
    assert deltas[1]["generation_tokens_total"] == 7
