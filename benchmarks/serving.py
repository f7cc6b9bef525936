"""Online serving benchmark: the OpenAI async client against `tokenmill serve`, and against
llama-cpp-python's server on the same GGUF when it is installed, in the same run.

    python benchmarks/serving.py [--model PATH.gguf] [--concurrency 1 8 32]
                                 [--prompt-len 128] [--max-tokens 64]

Each server runs in its own process (as deployed); this process only sends requests.
At each concurrency level C, C clients each send requests back to back (2 * C requests
in all, at least 4) with random prompts of exactly --prompt-len tokens (token-id
prompts for tokenmill; the same text for llama.cpp) and greedy decoding of
--max-tokens tokens (tokenmill ignores EOS so each request makes all of them;
llama.cpp's counts are the streamed tokens). Reported: time to first token (mean, p50, p99), inter-token
latency (mean gap between two streamed tokens), and output tokens/s (all tokens /
wall time of the level). Default model: the embedded SmolLM2-135M GGUF.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import table, wait_healthy  # noqa: E402


@dataclass(frozen=True)
class Level:
    concurrency: int
    ttft: list[float]
    itl: list[float]
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str
    model: str
    extra: dict
    """Extra request fields (tokenmill: ignore_eos, so every request makes max_tokens)."""
    usage: bool
    """The server reports usage at the end of a stream (stream_options.include_usage)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tokenmill(model: str, port: int, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.entrypoints.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-queued-requests",
        "4096",
        *extra,
    ]
    proc = subprocess.Popen(cmd)
    wait_healthy(f"http://127.0.0.1:{port}/health", proc)
    return proc


def start_llama_cpp(model: str, port: int, n_ctx: int) -> subprocess.Popen:
    """llama-cpp-python's server as vs_llamacpp.py starts it: concurrent requests queue
    (by default a new one cuts the running one short) and no AMX repack buffers."""
    from llama_server import start_llama_cpp as start

    return start(model, port, n_ctx, os.cpu_count() or 1, extra_bufts=False)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def random_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """Token-id prompts of exactly `length` tokens that survive decode -> encode."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        words = [rng.choice(WORDS) for _ in range(length * 2)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:length]
        prompts.append(ids)
    return prompts


WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact river stone light "
    "music garden window paper story city road market water forest"
).split()


async def one_request(client, target: Target, prompt, max_tokens: int):
    start = time.perf_counter()
    stream = await client.completions.create(
        model=target.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=target.extra,
        **({"stream_options": {"include_usage": True}} if target.usage else {}),
    )
    stamps, tokens = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if getattr(chunk, "usage", None):
            tokens = chunk.usage.completion_tokens
    if not stamps:
        return None, [], tokens or 0
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, tokens if tokens is not None else len(stamps)


async def run_level(target: Target, prompts: list, concurrency: int, max_tokens: int) -> Level:
    import openai

    client = openai.AsyncOpenAI(base_url=target.base_url, api_key="x", max_retries=0, timeout=600)
    todo = list(prompts)
    ttft, itl, tokens = [], [], 0

    async def worker() -> None:
        nonlocal tokens
        while todo:
            first, gaps, n = await one_request(client, target, todo.pop(), max_tokens)
            if first is not None:
                ttft.append(first)
            itl.extend(gaps)
            tokens += n

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    return Level(concurrency, ttft, itl, tokens, seconds)


def bench(target: Target, prompt_sets: dict[int, list], args) -> dict[int, Level]:
    asyncio.run(run_level(target, prompt_sets[1][:1], 1, 4))  # warm up
    out = {}
    for c in args.concurrency:
        out[c] = asyncio.run(run_level(target, prompt_sets[c], c, args.max_tokens))
        lv = out[c]
        print(f"  {target.name} c={c}: {lv.tokens} tokens in {lv.seconds:.1f}s", flush=True)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(results: dict[str, dict[int, Level]], args) -> None:
    rows = [
        ["server", "conc", "TTFT mean ms", "TTFT p50 ms", "TTFT p99 ms", "ITL mean ms", "out tok/s"]
    ]
    for name, levels in results.items():
        for c, lv in levels.items():
            rows.append(
                [
                    name,
                    str(c),
                    f"{1e3 * statistics.fmean(lv.ttft):.0f}",
                    f"{1e3 * pct(lv.ttft, 0.5):.0f}",
                    f"{1e3 * pct(lv.ttft, 0.99):.0f}",
                    f"{1e3 * statistics.fmean(lv.itl or [float('nan')]):.1f}",
                    f"{lv.tokens_per_s:.1f}",
                ]
            )
    print()
    print(table(rows))
    if "tokenmill" in results and "llama.cpp" in results:
        rows = [["conc", "TTFT (tm / llama.cpp)", "ITL (tm / llama.cpp)", "tok/s (tm / llama.cpp)"]]
        for c in args.concurrency:
            tm, lc = results["tokenmill"][c], results["llama.cpp"][c]
            rows.append(
                [
                    str(c),
                    f"{statistics.fmean(tm.ttft) / statistics.fmean(lc.ttft):.2f}",
                    f"{statistics.fmean(tm.itl) / statistics.fmean(lc.itl):.2f}",
                    f"{tm.tokens_per_s / lc.tokens_per_s:.2f}",
                ]
            )
        print()
        print("ratios (< 1 is better for latency, > 1 is better for tok/s):")
        print(table(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", help="GGUF file or HF folder (default: the embedded SmolLM2-135M)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenmill-args",
        default="",
        help="extra `tokenmill serve` flags, e.g. '--max-num-batched-tokens 512'",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip llama.cpp's server")
    args = parser.parse_args()

    from tokenmill.loader.resolve import default_model_path

    model = args.model or default_model_path()
    from transformers import AutoTokenizer

    if Path(model).is_dir():  # an HF folder
        tok = AutoTokenizer.from_pretrained(model)
    else:
        tok = AutoTokenizer.from_pretrained(str(Path(model).parent), gguf_file=Path(model).name)
    prompt_sets = {
        c: random_prompts(tok, max(4, 2 * c), args.prompt_len, args.seed + c)
        for c in [1, *args.concurrency]
    }
    print(
        f"model {model}; prompts of {args.prompt_len} tokens, {args.max_tokens} output "
        f"tokens, greedy; {os.cpu_count()} CPUs",
        flush=True,
    )

    results: dict[str, dict[int, Level]] = {}
    port = free_port()
    proc = start_tokenmill(model, port, shlex.split(args.tokenmill_args))
    try:
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        target = Target(
            "tokenmill", f"http://127.0.0.1:{port}/v1", name, {"ignore_eos": True}, usage=True
        )
        results["tokenmill"] = bench(target, prompt_sets, args)
    finally:
        stop(proc)

    if args.no_peer:
        pass
    elif Path(model).is_dir():
        print("\nllama.cpp: skipped (it takes a GGUF file, not an HF folder)")
    elif importlib.util.find_spec("llama_cpp") is None:
        print(
            "\nllama.cpp: skipped (llama-cpp-python[server] is not installed; "
            "`pip install 'llama-cpp-python[server]'` to compare on the same GGUF)"
        )
    else:
        port = free_port()
        n_ctx = args.prompt_len + args.max_tokens + 64
        proc = start_llama_cpp(model, port, n_ctx * max(args.concurrency))
        try:
            text_sets = {c: [tok.decode(p) for p in ps] for c, ps in prompt_sets.items()}
            target = Target("llama.cpp", f"http://127.0.0.1:{port}/v1", model, {}, usage=False)
            results["llama.cpp"] = bench(target, text_sets, args)
        finally:
            stop(proc)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
