"""``tokenmill serve --data-parallel-size 2``: one server, two Ray replicas, TP=1's answers."""

from __future__ import annotations

import asyncio
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
from scale_out_models import save_family

from tokenmill import LLM, SamplingParams

pytest.importorskip("ray")  # the test extra installs it (make setup)

PROMPTS = [[5 + i, 6, 7, 8 + i, 9] for i in range(8)]


def _read_lines(stream, out: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)


def _start(path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(path), "--port", "0",
           "--served-model-name", "m", "--num-kv-blocks", "64", "--dtype", "float32",
           "--data-parallel-size", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    log: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            log.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        if match := re.search(r"OpenAI API at (http://\S+)/v1", log[-1]):
            return proc, match.group(1)
    proc.kill()
    pytest.fail("tokenmill serve -dp 2 did not come up:\n" + "".join(log))


async def _complete_all(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(ids):
            body = {"model": "m", "prompt": ids, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def _metrics_once(url: str, pattern: str, timeout: float = 15.0) -> str:
    """/metrics once it shows ``pattern`` (else as it is at ``timeout``): the replicas'
    counters reach the router with their engines' snapshots and its monitor thread's merge,
    a little after the responses (a loaded CI machine once read the sum before it landed)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = httpx.get(url + "/metrics").text
        if re.search(pattern, metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_serve_dp2_routes_and_reports_replicas(tmp_path, smollm2_hf_tokenizer):
    path = save_family("qwen2", tmp_path / "m", smollm2_hf_tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    proc, url = _start(path)
    try:
        assert asyncio.run(_complete_all(url)) == [o.outputs[0].text for o in outs]
        health = httpx.get(url + "/health").json()
        assert health == {"status": "ok", "replicas": 2, "replicas_up": 2}
        summed = r"tokenmill:generation_tokens_total\{.*\} 48"  # the replicas' sum
        metrics = _metrics_once(url, summed)
        routed = [float(m) for m in re.findall(r'tokenmill:router_requests_total\{.*\} (\S+)',
                                               metrics)]  # fmt: skip
        assert len(routed) == 2 and sum(routed) == len(PROMPTS)
        assert 'tokenmill:replica_up{model_name="m",replica="1"} 1.0' in metrics
        assert re.search(summed, metrics)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
