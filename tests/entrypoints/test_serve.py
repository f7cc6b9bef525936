"""``LLM.serve`` in a thread, and ``tokenmill serve`` as a real process: API key on every
route, SIGTERM drains (the accepted stream finishes, the process exits 0)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _serving_helpers import MODEL, tiny_engine_llm, wait_for


def test_llm_serve_blocks_until_close(tiny_llama_dir):
    llm = tiny_engine_llm(tiny_llama_dir)
    thread = threading.Thread(target=llm.serve, kwargs=dict(port=0, log_level="warning"))
    thread.start()
    wait_for(
        lambda: llm._server is not None and llm._server.state.ready,
        timeout=30,
        what="LLM.serve to be ready",
    )
    url = llm._server.url
    r = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    metrics = llm.get_scheduling_metrics()
    assert metrics["submitted"] == 1 and metrics["completed"] == 1 and metrics["refused"] == 0
    assert set(metrics) == {
        "submitted",
        "refused",
        "completed",
        "cancelled",
        "failed",
        "queue_latency_avg_s",
        "queue_latency_max_s",
        "queued",
        "running",
    }
    llm.close()  # drains the server; serve() returns
    thread.join(timeout=30)
    assert not thread.is_alive()


def _read_lines(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)


@pytest.fixture
def cli_server(tiny_llama_dir):
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        str(tiny_llama_dir),
        "--port",
        "0",
        "--api-key",
        "sekret",
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        "128",
        "--block-size",
        "4",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    url, log = None, []
    deadline = time.monotonic() + 120
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        log.append(line)
        match = re.search(r"OpenAI API at (http://\S+)/v1", line)
        url = match.group(1) if match else None
    if url is None:
        proc.kill()
        pytest.fail("tokenmill serve did not come up:\n" + "".join(log))
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


ROUTES = [
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
    ),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/no-such-route", None),
]


def test_cli_serve_api_key_and_sigterm_drain(cli_server):
    proc, url = cli_server
    good = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200  # no key needed
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = http.request(method, path, json=body, headers=good)
            assert r.status_code == (404 if path == "/no-such-route" else 200), (path, r.text)
        body = {
            "model": MODEL,
            "prompt": "A long story",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body, headers=good) as r:
            events = r.iter_lines()
            lines = [next(events)]
            proc.send_signal(signal.SIGTERM)  # drains: this stream still runs to the end
            lines += list(events)
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0


def test_health_is_503_while_loading(tiny_llama_dir):
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    release = threading.Event()
    llms = []

    def load():
        assert release.wait(30)
        llms.append(tiny_engine_llm(tiny_llama_dir))
        return llms[0].engine

    srv = OpenAIServer(load, ServerConfig(port=0, log_level="warning"), model_name=MODEL).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "loading"
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
            release.set()
            srv.wait_ready(timeout=60)
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        release.set()
        srv.close(timeout=30)
        for llm in llms:
            llm.close()
