"""``tokenmill serve --tensor-parallel-size 2``: a real server process answers as TP=1 does."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
from scale_out_models import save_family

from tokenmill import LLM, SamplingParams
from tokenmill.inputs import TokensPrompt

IDS = [5, 6, 7, 8, 9]  # the tiny model's vocabulary is the tokenizer's first 512 ids


def _read_lines(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)


def _start(path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(path), "--port", "0",
           "--served-model-name", "m", "--num-kv-blocks", "64", "--dtype", "float32",
           "--tensor-parallel-size", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    log: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            log.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if match := re.search(r"OpenAI API at (http://\S+)/v1", log[-1]):
            return proc, match.group(1)
    proc.kill()
    pytest.fail("tokenmill serve -tp 2 did not come up:\n" + "".join(log))


def test_serve_tp2_answers_like_tp1(tmp_path, smollm2_hf_tokenizer):
    path = save_family("qwen2", tmp_path / "m", smollm2_hf_tokenizer)
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        [ref] = llm.generate([TokensPrompt(prompt_token_ids=IDS)], greedy, use_tqdm=False)
    proc, url = _start(path)
    try:
        body = {"model": "m", "prompt": IDS, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
