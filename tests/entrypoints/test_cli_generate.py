"""`tokenmill generate` in a subprocess: the answer on stdout, one line, logs apart."""

from __future__ import annotations

import subprocess
import sys


def test_generate_prints_the_answer_and_keeps_request_logs_out(tiny_llama_dir):
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--dtype",
        "float32",
        "Hello there",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and done.stdout.strip()
    assert "model ready" in done.stderr  # load progress is shown...
    assert "prompt tokens from the prefix cache" not in done.stderr  # ...per-request lines not
