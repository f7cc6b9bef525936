"""Shared helpers for the benchmarks: timing, bandwidth, model bytes, tables."""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median wall time of fn() over `repeat` runs, seconds (the machine is shared and noisy)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_runs(
    generate: Callable[[int], object], n: int, repeat: int, probe: Callable[[], float] | None = None
) -> tuple[list[float], list[float]]:
    """Single-stream decode tok/s of each of ``repeat`` runs of ``generate(n)`` (n tokens from
    a fixed prompt), less the time of ``generate(1)`` (the prefill and first token), and, with
    ``probe``, the higher of its values right before and right after each run (this VM's
    bandwidth moves within minutes: one sample for all runs can be far from what a run saw)."""
    t_first = best_of(lambda: generate(1), repeat)
    rates, probed = [], []
    for _ in range(repeat):
        before = probe() if probe else 0.0
        start = time.perf_counter()
        generate(n)
        rates.append((n - 1) / (time.perf_counter() - start - t_first))
        if probe:
            probed.append(max(before, probe()))
    return rates, probed


def in_fresh_process(fn: Callable[..., dict], *args) -> dict:
    """fn(*args) in a new (spawned) process: a peer library loaded there (llama.cpp and its
    thread pool) leaves nothing behind in this one (in-process, llama.cpp's threads slowed
    tokenmill's speculative steps by ~20% on 2 cores)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def copy_bandwidth(mib: int = 512, repeat: int = 5) -> float:
    """Memory traffic of a large tensor copy, bytes read + written per second (STREAM's
    convention for copy); reading the weights once per decode step is bounded by it."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = best_of(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() * 4 / seconds


def weight_bytes_per_decode_step(model: torch.nn.Module, vocab_size: int, hidden: int) -> int:
    """Bytes of weights a decode step reads: every parameter except the embedding table,
    of which one row per token is read (a tied lm_head reads the whole table once)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    has_head = any("lm_head" in n for n, _ in model.named_parameters())
    if not has_head:  # tied: the logits read the embedding matrix
        total += vocab_size * hidden * next(model.parameters()).element_size()
    return total


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def wait_healthy(url: str, proc, timeout: float = 300) -> None:
    """Poll ``url`` until it answers 200; raise if ``proc`` (a Popen) exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")
