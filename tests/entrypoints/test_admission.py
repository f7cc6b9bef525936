"""Admission control (429 / 503), disconnects that free KV blocks, draining shutdown.

Engine steps are slowed down (``slow_steps``) so that "still running" is certain.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from _serving_helpers import MODEL, all_blocks_free, slow_steps, tiny_engine_llm, wait_for

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.state import ServerConfig

LONG = {
    "model": MODEL,
    "prompt": "A long story",
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def busy_server(tiny_llama_dir):
    """One sequence at a time, at most one waiting, 0.5 s queue timeout, 20 ms steps."""
    llm = tiny_engine_llm(tiny_llama_dir, max_num_seqs=1)
    config = ServerConfig(port=0, log_level="warning", max_queued_requests=1, queue_timeout=0.5)
    srv = OpenAIServer(llm.engine, config).start()
    slow_steps(srv, 0.02)
    yield srv
    srv.close(timeout=30)
    llm.close()


def _first_event(lines) -> dict:
    """The first SSE event; keep ``lines`` alive (dropping the iterator closes the stream)."""
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no event")


def test_queue_full_429_then_queue_timeout_503(busy_server):
    srv = busy_server
    stats = srv.state.llm.stats
    results: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            a_lines = running.iter_lines()
            _first_event(a_lines)  # A is running (max_num_seqs=1)

            def waiter():
                with httpx.Client(base_url=srv.url, timeout=30) as other:
                    results["b"] = other.post("/v1/completions", json={**LONG, "max_tokens": 2})

            b = threading.Thread(target=waiter)
            b.start()
            wait_for(lambda: srv.state.llm.num_queued == 1, what="B to be queued")
            refused = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert refused.status_code == 429
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
            b.join(timeout=20)  # A still runs for ~4 s: B waits past queue_timeout
            assert results["b"].status_code == 503
            assert results["b"].json()["error"]["code"] == "queue_timeout"
            del a_lines
        metrics = http.get("/metrics").text
    assert stats.refused_queue_full == 1 and stats.refused_queue_timeout == 1
    assert 'tokenmill:request_refused_total{model_name="tiny",reason="queue_full"} 1.0' in metrics
    wait_for(lambda: all_blocks_free(srv), what="blocks freed after A was abandoned")
    assert stats.scheduling_metrics()["refused"] == 2


def test_openai_client_sees_rate_limit(busy_server):
    openai = pytest.importorskip("openai")
    srv = busy_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)
    a = client.completions.create(
        stream=True,
        **{k: v for k, v in LONG.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True},
    )
    next(iter(a))
    waiter = threading.Thread(
        target=lambda: _swallow(
            lambda: client.completions.create(model=MODEL, prompt="b", max_tokens=2)
        )
    )
    waiter.start()
    wait_for(lambda: srv.state.llm.num_queued == 1, what="B to be queued")
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="c", max_tokens=2)
    a.close()
    waiter.join(timeout=20)
    wait_for(lambda: all_blocks_free(srv), what="blocks freed")


def _swallow(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - B may time out in the queue; not what is tested
        pass


def test_abandoned_stream_frees_blocks(busy_server):
    srv = busy_server
    kv = srv.state.llm.engine.kv
    cancelled = srv.state.llm.stats.cancelled
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            _first_event(lines)
            assert kv.num_free_blocks < kv.num_blocks
        start = time.monotonic()  # the response is closed: the client went away
        wait_for(lambda: all_blocks_free(srv), timeout=2, what="blocks back after disconnect")
    assert time.monotonic() - start < 1.0  # ~4 s of generation was left
    assert srv.state.llm.stats.cancelled == cancelled + 1


def test_abandoned_non_streaming_request_frees_blocks(busy_server):
    srv = busy_server
    with httpx.Client(base_url=srv.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=LONG)  # ~4 s of work
    wait_for(lambda: all_blocks_free(srv), timeout=2, what="blocks back after the client left")


def test_drain_on_close_finishes_accepted_work(tiny_llama_dir):
    llm = tiny_engine_llm(tiny_llama_dir)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="warning")).start()
    slow_steps(srv, 0.01)
    body = {**LONG, "max_tokens": 60, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = r.iter_lines()
            lines = [next(events)]
            closer = threading.Thread(target=srv.close, kwargs={"timeout": 30})
            closer.start()
            wait_for(lambda: srv.state.draining, what="draining")
            assert http.get("/health").status_code == 503
            refused = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            lines += list(events)
        closer.join(timeout=30)
    assert not closer.is_alive()
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert llm.get_scheduling_metrics()["completed"] == 1
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.close()


def test_second_signal_exits_at_once(tiny_llama_dir):
    llm = tiny_engine_llm(tiny_llama_dir)
    srv = OpenAIServer(llm.engine, ServerConfig(port=0, log_level="critical")).start()
    slow_steps(srv, 0.02)
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            events = r.iter_lines()
            next(events)
            srv._uv.handle_exit(signal.SIGTERM, None)  # drain ...
            wait_for(lambda: srv.state.draining, what="draining")
            start = time.monotonic()
            srv._uv.handle_exit(signal.SIGTERM, None)  # ... no: exit now
            srv._thread.join(timeout=10)
            assert not srv._thread.is_alive() and time.monotonic() - start < 5
            rest = [line for line in events if line]  # cut short: ~4 s were left
            # The cut stream ends with an error event (not a silent close), then [DONE].
            assert any('"error"' in line and "shut down" in line for line in rest), rest[-3:]
            assert srv.exit_code == 1
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.close()
