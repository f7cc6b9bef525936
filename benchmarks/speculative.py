"""Speculative decoding, side by side in one run (2 cores: run it on a quiet machine).

1. The verify-cost curve t(k)/t(1), k = 1..8: one sequence verifying k - 1 drafts
   against a plain decode step, on SmolLM2-135M Q4_1 (goal t(8)/t(1) <= 1.5), for both
   activation precisions (high: two int8 terms, the default; low: one, as llama.cpp).
2. A copy-heavy workload (repeat / quote / edit a given text; SmolLM2 copies exactly at
   temperature 0): tokens/s with prompt lookup and with suffix decoding vs speculation off
   (goal >= 2x) and vs llama.cpp's prompt-lookup decoding on the same GGUF
   (``llama-cpp-python``'s ``LlamaPromptLookupDecoding``; goal >= 2x its rate).
3. A free-form chat workload: speculation (adaptive) on vs off (goal >= 1.0x).
   Both workloads also run suffix decoding with draft trees (draft_top_k=2, 2k nodes).
4. With --draft-pair (or --draft-pair-only): Qwen2.5-Coder-1.5B with the 0.5B draft on
   code generation (``make setup-slow`` installs the chunks): tokens/s with speculation
   off, k = 2..5 fixed and adaptive (one engine, columns swapped into its hook), speedup
   over no speculation (goal >= 1.5x) and mean acceptance length per column.

    python benchmarks/speculative.py [--k 8] [--repeat 3] [--curve-only] [--draft-pair]
    python benchmarks/speculative.py --draft-pair-only [--repeat 1] [--pair-max-tokens 128]
    ... [--activation-precision low]   # the workloads and the pair with one int8 term
    ... [--draft-quantization int4]    # the pair's draft requantized at load

Rates are medians over ``--repeat`` rounds, the configurations alternating within a round.
llama.cpp runs in a fresh process each round: in this one its threads slowed tokenmill's
speculative engines by ~20% (copy workload, 2 cores), not its plain decode.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import in_fresh_process, table

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.adaptive import DraftLength
from tokenmill.spec_decode.calibrate import measure_cost_curve
from tokenmill.spec_decode.metrics import SpecDecodeStats
from tokenmill.spec_decode.proposer import DraftHook

TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, the members agreed to increase funding for the library by ten percent, "
    "to repair the roof of the community hall, and to hire two more teachers for the "
    "primary school. The treasurer warned that these changes would require a small rise "
    "in local taxes, but most residents supported the plan."
)
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "Quote this paragraph in full, inside double quotes, and nothing else:\n\n" + TEXT,
    "Rewrite this text with 'Tuesday' changed to 'Friday', keeping everything else the "
    "same:\n\n" + TEXT,
]
CHAT_TASKS = [
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
]
CODE_TASKS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
    "docstring and type hints.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
]


def smollm2() -> str:
    from tokenmill.loader.resolve import default_model_path

    return default_model_path()


def prompts(llm: LLM, tasks: list[str]) -> list[list[int]]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True
        )
        for t in tasks
    ]


def tm_rate(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(tokens/s, tokens) of one greedy request alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    return len(out.token_ids) / (time.perf_counter() - start), len(out.token_ids)


def llama_cpp_rate(llama, ids: list[int], max_tokens: int, eos: int) -> tuple[float, int]:
    llama.reset()
    start, n = time.perf_counter(), 0
    for token in llama.generate(ids, top_k=1, temp=0.0, reset=True):
        if token == eos:
            break
        n += 1
        if n == max_tokens:
            break
    return n / (time.perf_counter() - start), n


def workload_rate(run, ids_list: list[list[int]], max_tokens: int) -> float:
    """Total tokens / total seconds of ``run`` over the prompts, one at a time."""
    total_tokens, total_s = 0, 0.0
    for ids in ids_list:
        rate, n = run(ids, max_tokens)
        total_tokens += n
        total_s += n / rate if rate else 0.0
    return total_tokens / total_s if total_s else 0.0


def run_workload(
    runners: dict,
    ids_list: list[list[int]],
    max_tokens: int,
    repeat: int,
    per_round: Callable[[], dict[str, float]] | None = None,
):
    """Median rates over ``repeat`` rounds; ``per_round`` adds other columns each round."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeat):
        for name, run in runners.items():  # alternating: noise hits every configuration
            rates[name].append(workload_rate(run, ids_list, max_tokens))
        for name, rate in (per_round() if per_round else {}).items():
            rates.setdefault(name, []).append(rate)
    return {name: statistics.median(r) for name, r in rates.items()}


def llama_cpp_round(
    path: str, k: int, ids_list: list[list[int]], max_tokens: int, eos: int
) -> dict[str, float]:
    """llama.cpp plain and with prompt lookup over the workload, in the process this runs in
    (a fresh one per round: llama.cpp's threads must not share a process with tokenmill's
    OpenMP pool, where they slowed tokenmill's speculative engines by ~20%)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from llama_server import NO_EXTRA_BUFTS

    exec(NO_EXTRA_BUFTS, {})
    common = dict(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False)
    engines = {
        "llama.cpp": Llama(**common),
        "llama.cpp lookup": Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k)),
    }  # fmt: skip
    out = {}
    for name, llama in engines.items():
        llama_cpp_rate(llama, ids_list[0], 16, eos)  # warm-up
        run = functools.partial(llama_cpp_rate, llama, eos=eos)
        out[name] = workload_rate(run, ids_list, max_tokens)
    return out


def mean_acceptance(llm: LLM) -> float:
    (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    return hook.stats.mean_acceptance_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="most drafts per step")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--draft-pair", action="store_true", help="also the Qwen2.5-Coder pair")
    ap.add_argument("--draft-pair-only", action="store_true", help="only the Qwen2.5-Coder pair")
    ap.add_argument("--pair-max-tokens", type=int, default=128, help="new tokens per code task")
    ap.add_argument("--curve-only", action="store_true", help="only the verify-cost curves")
    ap.add_argument("--draft-quantization", default=None, choices=("int8", "int4"),
                    help="the pair's draft weights (default: as stored, Q8_0)")  # fmt: skip
    ap.add_argument("--activation-precision", default="high", choices=("high", "low"),
                    help="of every engine past the curves (both precisions there)")  # fmt: skip
    args = ap.parse_args()
    if args.draft_pair_only:
        return draft_pair(args)
    path = smollm2()
    k = args.k

    precision = args.activation_precision
    engines = {p: LLM(path, activation_precision=p) for p in ("high", "low")}
    print("verify cost t(k)/t(1), one sequence, SmolLM2-135M Q4_1 (t(1) in ms):")
    rows = [["activations", *map(str, range(1, k + 1)), "t(1)"]]
    curves = {p: [] for p in engines}
    for _ in range(args.repeat):  # alternating, so drift hits both alike
        for p, llm in engines.items():
            curves[p].append(measure_cost_curve(llm.engine.runner, llm.engine.kv, k, k + 1, 1))
    for p, measured in curves.items():
        ratios = [statistics.median(c.ratio(j) for c in measured) for j in range(1, k + 1)]
        t1 = statistics.median(float(c(np.array([1]))[0]) for c in measured) * 1e3
        rows.append([p, *(f"{r:.2f}" for r in ratios), f"{t1:.2f}"])
    print(table(rows))
    if args.curve_only:
        return
    plain = engines[precision]
    engines.pop("low" if precision == "high" else "high").close()

    def spec(**config) -> LLM:
        config = {"num_speculative_tokens": k, **config}
        return LLM(path, activation_precision=precision, speculative_config=config)

    ngram = spec(method="ngram")
    suffix = spec(method="suffix")
    tree = spec(method="suffix", draft_top_k=2, verify_tree_size=2 * k)
    runners = {
        "off": lambda ids, n: tm_rate(plain, ids, n),
        "ngram": lambda ids, n: tm_rate(ngram, ids, n),
        "suffix": lambda ids, n: tm_rate(suffix, ids, n),
        "suffix tree": lambda ids, n: tm_rate(tree, ids, n),
    }
    copy_ids = prompts(plain, COPY_TASKS)
    llama_cpp = None
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: no llama.cpp columns", file=sys.stderr)
    else:
        eos = plain.tokenizer.eos_token_ids
        lc_args = (path, k, copy_ids, args.max_tokens, min(eos) if eos else -1)
        llama_cpp = functools.partial(in_fresh_process, llama_cpp_round, *lc_args)
    for run in runners.values():  # warm-up (and the suffix index sees one pass)
        run(copy_ids[0], 16)
    copy = run_workload(runners, copy_ids, args.max_tokens, args.repeat, llama_cpp)
    chat = run_workload(
        {n: runners[n] for n in ("off", "ngram", "suffix", "suffix tree")},
        prompts(plain, CHAT_TASKS), args.max_tokens, args.repeat,
    )  # fmt: skip
    rows = [["workload", *copy.keys(), "ngram/off", "suffix/off", "tree/off"]]
    for label, res in (("copy", copy), ("chat", chat)):
        rows.append([
            label, *(f"{res[c]:.1f}" if c in res else "-" for c in copy),
            f"{res['ngram'] / res['off']:.2f}x", f"{res['suffix'] / res['off']:.2f}x",
            f"{res['suffix tree'] / res['off']:.2f}x",
        ])  # fmt: skip
    print("\ntokens/s, one request at a time, greedy (median of rounds; suffix decoding's")
    print("shared index remembers the earlier rounds' outputs of the same prompts):")
    print(table(rows))
    if "llama.cpp lookup" in copy:
        lc = copy["llama.cpp lookup"]
        print(
            f"copy vs llama.cpp prompt lookup: ngram {copy['ngram'] / lc:.2f}x, "
            f"suffix {copy['suffix'] / lc:.2f}x (llama.cpp lookup / plain "
            f"{lc / copy['llama.cpp']:.2f}x)"
        )
    print(
        f"mean acceptance length: ngram {mean_acceptance(ngram):.2f}, "
        f"suffix {mean_acceptance(suffix):.2f}, suffix tree {mean_acceptance(tree):.2f}"
    )
    if args.draft_pair:
        draft_pair(args)


PAIR_KS = (2, 3, 4, 5)
"""Fixed draft lengths of the pair's columns; the adaptive column caps at the largest."""


@dataclass
class PairConfig:
    """One column of the pair's table: a draft cap (None: speculation off) and its own
    acceptance counters, swapped into the one engine's hook while its requests run."""

    length: DraftLength | None
    stats: SpecDecodeStats | None


def pair_configs(hook: DraftHook) -> dict[str, PairConfig]:
    """Speculation off, k fixed for each of PAIR_KS, and the adaptive default, all on the
    same engine (target + draft loaded once: seven engines would not fit in memory)."""
    adaptive = hook.length
    configs = {"off": PairConfig(None, None)}
    for k in PAIR_KS:
        fixed = DraftLength(k, adaptive.curve, adaptive=False, proposal=adaptive.proposal)
        configs[f"k={k}"] = PairConfig(fixed, SpecDecodeStats(hook.proposer.name, k))
    configs["adaptive"] = PairConfig(adaptive, hook.stats)
    return configs


def pair_rate(llm: LLM, config: PairConfig, ids: list[int], max_tokens: int):
    """(tokens/s, tokens) of one greedy request under ``config``."""
    (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    if config.length is not None:
        hook.length, hook.num_tokens, hook.stats = (
            config.length,
            config.length.max_tokens,
            config.stats,
        )
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            disable_spec_decode=config.length is None)  # fmt: skip
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    rate = len(out.token_ids) / (time.perf_counter() - start)
    length = config.length  # progress on stderr: the pair's runs take minutes
    label = "off" if length is None else f"k={length.max_tokens}" + " adaptive" * length.adaptive
    print(f"  pair {label}: {len(out.token_ids)} tokens, {rate:.2f} tokens/s", file=sys.stderr)
    return rate, len(out.token_ids)


def draft_pair(args) -> None:
    """Qwen2.5-Coder-1.5B with its 0.5B draft on code generation: tokens/s off, with k
    fixed and adaptive (one engine; ``disable_spec_decode`` for the plain column)."""
    from tokenmill import native

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import qwen_coder_draft_path, qwen_coder_path

    target, draft = str(qwen_coder_path()), str(qwen_coder_draft_path())
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": max(PAIR_KS)}
    if args.draft_quantization:
        spec["quantization"] = args.draft_quantization
    llm = LLM(target, max_model_len=2048, activation_precision=args.activation_precision,
              speculative_config=spec)  # fmt: skip
    (hook,) = [h for h in llm.engine.hooks if isinstance(h, DraftHook)]
    configs = pair_configs(hook)
    ids_list = prompts(llm, CODE_TASKS)
    runners = {name: functools.partial(pair_rate, llm, c) for name, c in configs.items()}
    for run in runners.values():
        run(ids_list[0], 8)
    for c in configs.values():  # the warm-up's drafts are not counted
        if c.stats is not None:
            c.stats = SpecDecodeStats(c.stats.method, c.stats.max_tokens)
    res = run_workload(runners, ids_list, args.pair_max_tokens, args.repeat)
    isa = native.active_isa() if native.available() else "none (PyTorch kernels)"
    print(
        f"\nQwen2.5-Coder-1.5B Q4_K_M + 0.5B draft, code generation, {args.pair_max_tokens} "
        f"greedy tokens, tokens/s (native kernels: {isa}; adaptive caps at k={max(PAIR_KS)}):"
    )
    rows = [
        ["", *configs],
        ["tokens/s", *(f"{res[n]:.2f}" for n in configs)],
        ["vs off", *(f"{res[n] / res['off']:.2f}x" for n in configs)],
        [
            "mean acceptance length",
            "-",
            *(f"{c.stats.mean_acceptance_length:.2f}" for c in configs.values() if c.stats),
        ],
    ]
    print(table(rows))


if __name__ == "__main__":
    main()
