"""A child Python that counts its own threads (whether a thread holds OpenMP workers,
``tokenmill.threads.release_openmp_threads``) and how often a parallel op sleeps.
``run_probe(code)`` runs ``PRELUDE + code`` and returns its stdout."""

from __future__ import annotations

import subprocess
import sys

import pytest

on_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")

PRELUDE = """
import glob, os, sys, time
import torch
from tokenmill.threads import release_openmp_threads

torch.set_num_threads(2)

def tasks():
    return len(glob.glob(f"/proc/{os.getpid()}/task/*"))

def settle(want):
    deadline = time.monotonic() + 5
    while tasks() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return tasks()

x = torch.randn(1024, 1024)

def sleeps_per_op(n=200):
    # voluntary context switches of this thread per parallel op: ~0 while OpenMP's workers
    # spin-wait at barriers, ~1 or more once libgomp throttles them (more workers than CPUs)
    import threading

    status = f"/proc/self/task/{threading.get_native_id()}/status"

    def switches():
        for line in open(status):
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])

    y = torch.zeros(1 << 20)
    y.add_(1)
    before = switches()
    for _ in range(n):
        y.add_(1)
    return (switches() - before) / n
"""


def run_probe(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
