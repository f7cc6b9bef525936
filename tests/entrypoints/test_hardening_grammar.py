"""Hostile grammars against a real server: each is a 400 naming the limit (or saying that it
can never be satisfied) before any token, the process survives, and /health and a small
completion keep answering meanwhile."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from _serving_helpers import MODEL

CHAIN = 20_000


def _chain(n: int) -> str:
    return (
        "start: r0\n" + "".join(f'r{i}: "t{i}" | r{i + 1}\n' for i in range(n)) + f'r{n}: "end"\n'
    )


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


CASES = {
    "chained_rules": ({"guided_grammar": _chain(CHAIN)}, "--max-grammar-bytes"),
    "chained_rules_small_names": (
        {
            "guided_grammar": "start: a0\n"
            + "".join(f'a{i}: "x" | a{i + 1}\n' for i in range(3000))
            + 'a3000: "y"\n'
        },
        "--max-grammar-rules",
    ),
    "nested_repeat": ({"guided_regex": "a{1000}{1000}"}, "--max-grammar-repeat"),
    "triple_repeat": ({"guided_regex": "((a{100}){100}){100}"}, "--max-grammar-repeat"),
    "megabyte_literal": ({"guided_regex": "x" * 1_000_000}, "--max-grammar-bytes"),
    "no_base_case": ({"guided_grammar": 'start: "a" start'}, "can never be satisfied"),
    "root_is_root": ({"guided_grammar": "root ::= root"}, "can never be satisfied"),
    "anyof_5000": (
        {
            "guided_json": {
                "anyOf": [
                    {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
                    for i in range(5000)
                ]
            }
        },
        "--max-grammar-",
    ),
    "choice_50k": ({"guided_choice": [f"c{i}" for i in range(50_000)]}, "--max-grammar-"),
    "ref_cycle": (
        {
            "guided_json": {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            }
        },
        "can never be satisfied",
    ),
    "self_ref": ({"guided_json": {"$ref": "#"}}, "can never be satisfied"),
    "deep_schema": ({"guided_json": _nested_schema(300)}, "--max-grammar-depth"),
}


class _Prober:
    """Polls /health and a 1-token completion in the background; records the worst latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                r = c.get("/health")
                small = c.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}
                )
                self.worst = max(self.worst, time.monotonic() - t0)
                if r.status_code != 200 or small.status_code != 200:
                    self.failures.append(f"{r.status_code} {small.status_code}")
                time.sleep(0.05)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_grammar_is_a_400_and_the_server_keeps_serving(server, http, name):
    extra, words = CASES[name]
    with _Prober(server.url) as probe:
        t0 = time.monotonic()
        r = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 8, **extra}
        )
        elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert elapsed < 30  # generous: each is refused in well under a second here
    assert not probe.failures and probe.worst < 10
    assert http.get("/health").status_code == 200
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.status_code == 200


def test_an_ordinary_grammar_still_works(http):
    r = http.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "Say:",
            "max_tokens": 8,
            "guided_grammar": 'start: "x" ("y" | "z")',
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("xy", "xz")
