"""Aggregate decode throughput of N concurrent requests on a quantized GGUF (kept quantized,
the native int8 / int4 group kernels), this tree against another tokenmill tree.

    python benchmarks/batched_gguf.py                          # this tree only
    python benchmarks/batched_gguf.py --other /path/to/old/src # side by side, alternating
    python benchmarks/batched_gguf.py --precisions high,low    # this tree's activation
                                                               # precisions side by side

Each measurement runs in a fresh process (``PYTHONPATH`` set to the tree's ``src``), so the
two trees' native libraries and Python code never mix; the rounds alternate which tree
goes first, and the ratio is of the medians. Default model: the embedded SmolLM2-135M
Q4_1, 32 requests x 64 greedy tokens from short distinct prompts (the prefill is timed
apart and left out of the decode rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def measure(
    model: str | None, concurrency: int, tokens: int, threads: int, precision: str | None
) -> dict:
    """One engine, one warm-up round, then one timed round: decode tokens/s of the batch."""
    import time

    import torch

    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)
    options = {"activation_precision": precision} if precision else {}  # older trees: none
    llm = LLM(model, max_num_seqs=concurrency, enable_prefix_caching=False, **options)
    prompts = [
        f"Request {i}: write a short story about the number {i}." for i in range(concurrency)
    ]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels, allocations
    start = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"decode_tok_s": (generated - concurrency) / max(total - prefill, 1e-9),
            "total_tok_s": generated / total}  # fmt: skip


def run_tree(src: Path, precision: str | None, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--concurrency",
           str(args.concurrency), "--tokens", str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    if precision:
        cmd += ["--activation-precision", precision]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2 Q4_1)")
    ap.add_argument("--other", type=Path, default=None, help="another tree's src/ to compare")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", default=None,
                    help="this tree's activation precisions to compare, e.g. high,low "
                    "(default: the engine's default)")  # fmt: skip
    ap.add_argument("--activation-precision", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = measure(args.model, args.concurrency, args.tokens, args.threads,
                         args.activation_precision)  # fmt: skip
        print(json.dumps(result))
        return
    precisions = args.precisions.split(",") if args.precisions else [None]
    trees = {("this" if p is None else f"this {p}"): (SRC, p) for p in precisions}
    trees |= {"other": (args.other, None)} if args.other else {}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            results[name].append(run_tree(*trees[name], args))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    median = {n: statistics.median(x["decode_tok_s"] for x in rs) for n, rs in results.items()}
    print(f"\n{args.concurrency} requests x {args.tokens} tokens, {args.threads} threads, "
          f"median of {args.rounds}: decode tok/s " +
          ", ".join(f"{n} {v:.1f}" for n, v in median.items()))  # fmt: skip
    first = next(iter(median))
    for name, value in list(median.items())[1:]:
        print(f"{name} / {first} = {value / median[first]:.2f}x")


if __name__ == "__main__":
    main()
