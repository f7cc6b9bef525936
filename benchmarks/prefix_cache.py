"""Multi-turn chat with prefix caching on and off, side by side in one run.

    python benchmarks/prefix_cache.py [--model PATH] [--users 8] [--turns 4]

Workload: a shared system prompt of about 1k tokens, N users, T turns each; a
user's next turn is sent when its previous answer is complete (the answer and a
new user message are appended to the conversation), all users concurrently.
Reports TTFT p50/p95 (time from submission to the first token), output
throughput, total wall time and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sampling_params import RequestOutputKind  # noqa: E402

WORDS = (
    "river mountain policy engine garden theory market signal harbor lantern "
    "quartz meadow circuit ledger violin canyon orbit fabric glacier compass"
).split()


def system_prompt(n_words: int) -> str:
    rng = random.Random(0)
    return "You are a careful assistant. Background notes: " + " ".join(
        rng.choice(WORDS) for _ in range(n_words)
    )


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(llm: LLM, users: int, turns: int, out_tokens: int, system: str) -> dict[str, float]:
    eng = llm.engine
    params = SamplingParams(
        temperature=0, max_tokens=out_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    convs = [[{"role": "system", "content": system}] for _ in range(users)]
    turn_of = [0] * users
    pending: dict[str, tuple[int, float]] = {}
    first: dict[str, float] = {}
    answers: dict[str, list[int]] = {}
    ttfts: list[float] = []
    produced = 0

    def submit(u: int) -> None:
        convs[u].append(
            {
                "role": "user",
                "content": f"Question {turn_of[u] + 1} from user {u}: "
                f"summarize the notes about {WORDS[(u + turn_of[u]) % len(WORDS)]}.",
            }
        )
        ids = llm.tokenizer.apply_chat_template(convs[u])
        rid = eng.add_request(ids, params, f"u{u}-t{turn_of[u]}")
        pending[rid] = (u, time.perf_counter())
        answers[rid] = []

    start = time.perf_counter()
    for u in range(users):
        submit(u)
    while eng.has_unfinished():
        for out in eng.step():
            rid = out.request_id
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = time.perf_counter()
                ttfts.append(first[rid] - pending[rid][1])
            answers[rid] += out.outputs[0].token_ids
            if out.finished:
                u, _ = pending.pop(rid)
                produced += len(answers[rid])
                convs[u].append(
                    {"role": "assistant", "content": llm.tokenizer.decode(answers[rid])}
                )
                turn_of[u] += 1
                if turn_of[u] < turns:
                    submit(u)
    wall = time.perf_counter() - start
    m = llm.get_prefix_cache_metrics()
    return {
        "p50": percentile(ttfts, 0.5),
        "p95": percentile(ttfts, 0.95),
        "tput": produced / wall,
        "wall": wall,
        "hit_rate": m["prefix_cache_hit_rate"],
        "reused": m["prefix_cache_reused_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--out-tokens", type=int, default=32)
    ap.add_argument("--system-words", type=int, default=900, help="about 1 token per word")
    args = ap.parse_args()
    system = system_prompt(args.system_words)
    results = {}
    for enabled in (True, False):
        with LLM(
            args.model, dtype=args.dtype, enable_prefix_caching=enabled, max_model_len=4096
        ) as llm:
            n_sys = len(
                llm.tokenizer.apply_chat_template(
                    [{"role": "system", "content": system}], add_generation_prompt=False
                )
            )
            results["on" if enabled else "off"] = run(
                llm, args.users, args.turns, args.out_tokens, system
            )
    on, off = results["on"], results["off"]
    print(
        f"{args.users} users x {args.turns} turns, shared system prompt {n_sys} tokens, "
        f"{args.out_tokens} output tokens per turn, dtype {args.dtype}"
    )
    rows = [
        [
            "prefix caching",
            "TTFT p50 s",
            "TTFT p95 s",
            "output tok/s",
            "wall s",
            "hit rate",
            "reused tokens",
        ]
    ]
    for name, r in results.items():
        rows.append(
            [
                name,
                f"{r['p50']:.2f}",
                f"{r['p95']:.2f}",
                f"{r['tput']:.1f}",
                f"{r['wall']:.1f}",
                f"{r['hit_rate']:.0%}",
                str(r["reused"]),
            ]
        )
    print(table(rows))
    print(
        f"on/off: TTFT p50 {off['p50'] / on['p50']:.1f}x faster, p95 {off['p95'] / on['p95']:.1f}x faster, "
        f"throughput {on['tput'] / off['tput']:.2f}x"
    )


if __name__ == "__main__":
    main()
