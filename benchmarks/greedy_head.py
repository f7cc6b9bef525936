"""The greedy head on and off in one engine, alternating rounds (``sampling/greedy_head.py``).

    python benchmarks/greedy_head.py [--model HF_DIR] [--rounds 4] [--concurrency 32]

N concurrent greedy requests x 128 tokens (vs_transformers.py's prompts, 16-111 tokens,
no prefix caching) through one bfloat16 engine; each round runs the batch once with the
runner's greedy head and once without it (the order alternating), checks that both give
the same tokens, and the medians of the aggregate tokens/s are compared. One process and
one engine: the VM's slow spells fall on both sides. Default model: the embedded SmolLM2's
HF folder in bfloat16 (``vs_transformers.py --hf16 bf16`` makes it under ``--cache``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_transformers import make_hf16, prompt_ids  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="HF folder with bfloat16 weights (default: SmolLM2's)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of on + off (default 4)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests (default 32)")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "tokenmill-bench",
        help="where the default bf16 folder is made (default ~/.cache/tokenmill-bench)",
    )
    args = ap.parse_args()
    if args.model is None:
        from tokenmill.loader import default_model_path

        args.model = make_hf16(str(default_model_path()), "bf16", args.cache)
    c, n_out = args.concurrency, 128
    prompts = [{"prompt_token_ids": prompt_ids(16 + (i * 37) % 96, 100 + i)} for i in range(c)]
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    with LLM(args.model, enable_prefix_caching=False) as llm:
        runner = llm.engine.executor.runner
        head = runner.greedy_head
        if head is None:
            sys.exit("no greedy head here (needs AVX512-BF16 and a bfloat16 head on CPU)")

        def run(on: bool) -> tuple[float, list[list[int]]]:
            runner.greedy_head = head if on else None
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate = c * n_out / (time.perf_counter() - start)
            return rate, [list(o.outputs[0].token_ids) for o in outs]

        run(True)  # warm-up
        rates: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[list[int]]] = {}
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                rate, ids = run(on)
                rates[on].append(rate)
                assert tokens.setdefault(on, ids) == ids, "a round changed its own tokens"
        runner.greedy_head = head
    same = tokens[True] == tokens[False]
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"model: {args.model}; {c} requests x {n_out} greedy tokens, {args.rounds} rounds")
    print(f"greedy head on : {' '.join(f'{x:.0f}' for x in rates[True])} tok/s, median {on:.0f}")
    print(f"greedy head off: {' '.join(f'{x:.0f}' for x in rates[False])} tok/s, median {off:.0f}")
    print(f"on / off: {on / off:.2f}x; the same tokens: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
