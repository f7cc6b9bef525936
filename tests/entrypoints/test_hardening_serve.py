"""Server lifecycle under hostile conditions: a KV cache too small for one sequence fails
before the weights are read; a broken GGUF is one error line from ``tokenmill serve``;
a second SIGTERM (or a drain past --shutdown-timeout) cuts streams with an error event
and exits non-zero; a malformed tool schema is a 400 under tool_choice=auto too."""

from __future__ import annotations

import os
import queue
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest
from _serving_helpers import MODEL, chat_body

from tokenmill.errors import InvalidRequestError
from tokenmill.loader.checkpoint import Checkpoint


def test_kv_cache_too_small_fails_before_the_weights_are_read(tiny_llama_dir, monkeypatch):
    def no_reads(self, *args, **kwargs):
        raise AssertionError("the weights were read before the KV size was checked")

    monkeypatch.setattr(Checkpoint, "weights", no_reads)
    from tokenmill import LLM

    with pytest.raises(InvalidRequestError, match="can not hold one sequence"):
        LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=256,
            block_size=4,
            kv_cache_memory_bytes=4096,
        )


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
        "not a schema",
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    ],
)
def test_malformed_tool_schema_is_a_400_under_auto(http, parameters):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice="auto"))
    assert r.status_code == 400, r.text[:300]
    assert "tools[0]" in r.json()["error"]["message"]


def test_a_good_tool_schema_still_works_under_auto(http):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    r = http.post("/v1/chat/completions", json=chat_body(tools=tools, tool_choice="auto"))
    assert r.status_code == 200


def _serve(args: list[str]) -> tuple[subprocess.Popen, queue.Queue]:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def _url(proc: subprocess.Popen, lines: queue.Queue) -> str:
    deadline = time.monotonic() + 120
    log = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        log.append(line)
        match = re.search(r"OpenAI API at (http://\S+)/v1", line)
        if match:
            return match.group(1)
    proc.kill()
    pytest.fail("tokenmill serve did not come up:\n" + "".join(log))


def test_a_zero_alignment_gguf_is_one_error_line(tmp_path, smollm2_gguf):
    """general.alignment = 0 raised ZeroDivisionError: a 51-line traceback."""
    data = smollm2_gguf.read_bytes()[: 8 << 20]  # the header (and vocabulary) is all read
    key, new_key = b"llama.context_length", b"general.alignment"  # a uint32 KV, renamed
    i = data.index(key)
    data = data[: i - 8] + struct.pack("<Q", len(new_key)) + new_key + data[i + len(key) :]
    value = i + len(new_key) + 4  # after the key, its uint32 type id
    data = data[:value] + struct.pack("<I", 0) + data[value + 4 :]
    bad = tmp_path / "zero-align.gguf"
    bad.write_bytes(data)
    proc, lines = _serve([str(bad), "--port", "0"])
    assert proc.wait(timeout=120) == 2
    out = []
    while (line := lines.get(timeout=10)) is not None:
        out.append(line)
    text = "".join(out)
    assert "general.alignment = 0" in text and "Traceback" not in text, text[-2000:]


def test_second_sigterm_cuts_streams_with_an_error_and_exits_1(tiny_llama_dir):
    proc, lines = _serve(
        [
            str(tiny_llama_dir),
            "--port",
            "0",
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
    )
    try:
        url = _url(proc, lines)
        body = {
            "model": MODEL,
            "prompt": "A long story",
            "max_tokens": 250,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/completions", json=body) as r,
        ):
            events = r.iter_lines()
            seen = [next(events)]
            proc.send_signal(signal.SIGTERM)  # drain ...
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)  # ... no: exit now
            try:
                seen += [line for line in events if line]
            except httpx.HTTPError:
                pass
        assert proc.wait(timeout=30) == 1
        assert any('"error"' in line for line in seen), seen[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_min_tokens_over_the_context_is_refused_when_max_tokens_is_unset(tiny_llm):
    """Without max_tokens, min_tokens=10**12 was accepted and ran to the context limit."""
    from tokenmill import SamplingParams
    from tokenmill.errors import ContextLengthError

    with pytest.raises(ContextLengthError, match="min_tokens"):
        tiny_llm.generate(["hi"], SamplingParams(max_tokens=None, min_tokens=10**12))
