"""Hostile request bodies against a real server: bodies over the cap (413), prompts that can
not fit (refused without tokenizing), invalid Unicode, untrusted and expensive chat
templates, prompt lists, prompt_logprobs cost, absurd min_tokens, the content type, the
bearer scheme, and header timeouts. Each is a 4xx in the OpenAI error format while a
concurrent /health keeps answering; timing bounds are generous (not a benchmark)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from _serving_helpers import MODEL, chat_body, tiny_engine_llm

from tokenmill.entrypoints.openai.launcher import OpenAIServer
from tokenmill.entrypoints.openai.limits import ServerLimits
from tokenmill.entrypoints.openai.state import ServerConfig

STRICT = ServerLimits(
    max_request_body_bytes=1 << 20,
    trust_request_chat_template=True,
    chat_template_timeout=1.0,
    max_prompts_per_request=8,
    max_prompt_logprobs_cost=1000,
    timeout_headers=1.0,
    timeout_keep_alive=1.0,
)


@pytest.fixture(scope="module")
def strict(tiny_llama_dir) -> Iterator[OpenAIServer]:
    llm = tiny_engine_llm(tiny_llama_dir)
    srv = OpenAIServer(
        llm.engine, ServerConfig(port=0, log_level="warning", api_key="k3y", limits=STRICT)
    ).start()
    srv.wait_ready(60)
    yield srv
    srv.close(timeout=30)
    llm.close()


@pytest.fixture(scope="module")
def sc(strict) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=strict.url, timeout=60, headers={"Authorization": "Bearer k3y"}
    ) as c:
        yield c


class _Health:
    """Polls /health in the background; the worst latency it saw."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.bad = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Health:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                self.bad += c.get("/health").status_code != 200
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(0.02)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_two_million_character_message_is_refused_without_stalling(server, http):
    body = chat_body("x" * 2_000_000)
    with _Health(server.url) as health:
        t0 = time.monotonic()
        r = http.post("/v1/chat/completions", json=body)
        elapsed = time.monotonic() - t0
    error = _error(r, 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert elapsed < 10 and health.worst < 2 and health.bad == 0


def test_a_long_completion_prompt_is_refused_before_tokenizing(server, http):
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "ab " * 500_000, "max_tokens": 1}
    )
    error = _error(r, 400)  # refused from its length in characters, not after tokenizing
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]


def test_a_body_over_the_cap_is_a_413(strict, sc):
    big = json.dumps(chat_body("y" * (2 << 20)))
    with _Health(strict.url) as health:
        r = sc.post(
            "/v1/chat/completions", content=big, headers={"Content-Type": "application/json"}
        )
    error = _error(r, 413)
    assert "--max-request-body-bytes" in error["message"]
    assert health.worst < 2

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"z" * 65536

    r = sc.post(
        "/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert _error(r, 413)["code"] == "request_too_large"


def test_default_cap_refuses_twenty_megabytes_at_once(server, http):
    t0 = time.monotonic()
    r = http.post(
        "/v1/completions",
        content=b"{" + b" " * (20 << 20) + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert _error(r, 413)["code"] == "request_too_large" and time.monotonic() - t0 < 30


def test_a_text_plain_body_says_what_the_content_type_must_be(http):
    r = http.post(
        "/v1/completions",
        content=json.dumps({"model": MODEL, "prompt": "hi"}),
        headers={"Content-Type": "text/plain"},
    )
    assert "Content-Type" in _error(r, 400)["message"]


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", chat_body("bad \ud800 text")),
        ("/v1/completions", {"model": MODEL, "prompt": "bad \udfff", "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": ["fine", "bad \ud800"], "max_tokens": 2}),
    ],
)
def test_lone_surrogates_are_a_400(http, route, body):
    raw = json.dumps(body)  # json.dumps escapes a lone surrogate as \ud800
    r = http.post(route, content=raw, headers={"Content-Type": "application/json"})
    error = _error(r, 400)
    assert "not valid Unicode" in error["message"] and error["param"] in ("messages", "prompt")


def test_request_chat_template_is_off_by_default(http):
    r = http.post("/v1/chat/completions", json=chat_body(chat_template="{{ 'hi' }}"))
    error = _error(r, 400)
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


@pytest.mark.parametrize(
    "template, words",
    [
        (
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x",
            "--chat-template-timeout",
        ),
        ("{{ 'x' * 300000000 }}", "builds a value"),
        ("{% for i in range(100000000) %}{% endfor %}", "range()"),
        ("{% for i in range(9999) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "more than"),
    ],
)
def test_expensive_trusted_templates_are_bounded(strict, sc, template, words):
    with _Health(strict.url) as health:
        t0 = time.monotonic()
        r = sc.post("/v1/chat/completions", json=chat_body(chat_template=template))
        elapsed = time.monotonic() - t0
    assert words in _error(r, 400)["message"]
    assert elapsed < 15 and health.worst < 3


def test_a_trusted_request_template_renders(sc):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    r = sc.post("/v1/chat/completions", json=chat_body(chat_template=template, max_tokens=2))
    assert r.status_code == 200, r.text


def test_prompt_lists_are_capped(sc):
    r = sc.post(
        "/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 10_000, "max_tokens": 1}
    )
    assert "--max-prompts-per-request" in _error(r, 400)["message"]
    r = sc.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_prompt_logprobs_cost_is_capped(sc):
    prompt = "one two three four five six seven eight nine ten " * 10  # ~100 tokens
    r = sc.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20},
    )
    error = _error(r, 400)
    assert error["param"] == "prompt_logprobs" and "--max-prompt-logprobs-cost" in error["message"]
    r = sc.post("/v1/chat/completions", json=chat_body(prompt, prompt_logprobs=20))
    assert _error(r, 400)["param"] == "prompt_logprobs"
    r = sc.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hi there", "max_tokens": 1, "prompt_logprobs": 2},
    )
    assert r.status_code == 200


def test_absurd_min_tokens_is_a_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "min_tokens": 10**12})
    assert "min_tokens" in _error(r, 400)["message"]


def test_deep_schema_with_n_is_a_400_not_a_500(http):
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2, "guided_json": schema},
    )
    assert "--max-grammar-depth" in _error(r, 400)["message"]


def test_bearer_scheme_is_case_insensitive(strict):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(strict.url + "/v1/models", headers={"Authorization": f"{scheme} k3y"})
        assert r.status_code == 200, scheme
    r = httpx.get(strict.url + "/v1/models", headers={"Authorization": "bearer wrong"})
    assert r.status_code == 401


def test_slow_headers_are_cut(strict):
    """A client that opens a connection and trickles half a request line is closed after
    timeout_headers (1 s here); before, such sockets stayed open forever."""
    host, port = strict.url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]
    for s in sockets:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never end
    time.sleep(2.5)
    closed = 0
    for s in sockets:
        try:
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    assert closed == len(sockets)
    assert httpx.get(strict.url + "/health").status_code == 200
