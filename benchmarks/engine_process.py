"""Engine thread vs engine-core process behind the server (``--engine-process off|on``).

    python benchmarks/engine_process.py [--runs 3] [--concurrency 8 32]
                                        [--prompt-len 128] [--max-tokens 64]

``benchmarks/serving.py``'s load (its prompts, clients and levels: at concurrency C, C
streaming clients send 2 * C greedy requests back to back), against `tokenmill serve` in
each mode, alternating (thread, process, process, thread, ...) so that drifts of a shared
machine fall on both; the server is restarted for every run. Reported per mode and level:
the median over runs of output tokens/s, TTFT median and ITL median, and process/thread
ratios (tok/s > 1 and latencies < 1 favour the process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402
from serving import Target, free_port, random_prompts, run_level, start_tokenmill, stop  # noqa: E402

MODES = ("thread", "process")
FLAG = {"thread": "off", "process": "on"}


def one_run(model: str, mode: str, prompt_sets: dict, args) -> dict[int, dict[str, float]]:
    port = free_port()
    proc = start_tokenmill(model, port, ["--engine-process", FLAG[mode], *args.extra])
    try:
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        target = Target(mode, f"http://127.0.0.1:{port}/v1", name, {"ignore_eos": True}, True)
        asyncio.run(run_level(target, prompt_sets[1][:1], 1, 4))  # warm up
        out = {}
        for c in args.concurrency:
            lv = asyncio.run(run_level(target, prompt_sets[c], c, args.max_tokens))
            out[c] = {
                "tok_s": lv.tokens_per_s,
                "ttft_ms": 1e3 * statistics.median(lv.ttft),
                "itl_ms": 1e3 * statistics.median(lv.itl),
            }
            print(
                f"  {mode} c={c}: {lv.tokens_per_s:.1f} tok/s, TTFT p50 "
                f"{out[c]['ttft_ms']:.0f} ms, ITL p50 {out[c]['itl_ms']:.1f} ms",
                flush=True,
            )
        return out
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="further `tokenmill serve` flags (last)",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tokenmill.loader.resolve import default_model_path

    model = args.model or default_model_path()
    tok = AutoTokenizer.from_pretrained(str(Path(model).parent), gguf_file=Path(model).name)
    prompt_sets = {
        c: random_prompts(tok, max(4, 2 * c), args.prompt_len, args.seed + c)
        for c in [1, *args.concurrency]
    }
    print(
        f"model {model}; prompts of {args.prompt_len} tokens, {args.max_tokens} output "
        f"tokens, greedy; {os.cpu_count()} CPUs; started {time.strftime('%H:%M:%S UTC', time.gmtime())}",
        flush=True,
    )

    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(args.runs):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            print(f"run {i + 1}/{args.runs}: {mode}", flush=True)
            runs[mode].append(one_run(model, mode, prompt_sets, args))
    print(f"ended {time.strftime('%H:%M:%S UTC', time.gmtime())}")

    def med(mode: str, c: int, key: str) -> float:
        return statistics.median(r[c][key] for r in runs[mode])

    rows = [["conc", "mode", "tok/s", "TTFT p50 ms", "ITL p50 ms"]]
    ratios = [["conc", "tok/s (proc/thread)", "TTFT p50 (proc/thread)", "ITL p50 (proc/thread)"]]
    for c in args.concurrency:
        for mode in MODES:
            rows.append(
                [
                    str(c),
                    mode,
                    f"{med(mode, c, 'tok_s'):.1f}",
                    f"{med(mode, c, 'ttft_ms'):.0f}",
                    f"{med(mode, c, 'itl_ms'):.1f}",
                ]
            )
        ratios.append(
            [str(c)]
            + [
                f"{med('process', c, k) / med('thread', c, k):.2f}"
                for k in ("tok_s", "ttft_ms", "itl_ms")
            ]
        )
    print("\nmedians over runs:")
    print(table(rows))
    print("\nratios (tok/s > 1 and latencies < 1 favour the process):")
    print(table(ratios))
    print("\nraw:", json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
