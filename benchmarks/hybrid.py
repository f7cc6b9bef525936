"""Hybrid models: tokenmill vs transformers on the same random weights, side by side.

    python benchmarks/hybrid.py                      # Qwen3.5-0.8B shapes (configs/), float32
    python benchmarks/hybrid.py --layers 8 --prompt 256 --tokens 32   # at least 4 layers

The model has the shapes of ``configs/qwen3.5-0.8b-shaped.json`` (Gated DeltaNet and gated
attention, 3:1; the shapes as we take them from the published Qwen3.5-0.8B config) and
random weights, saved once under ``--cache``. Reported: prefill tokens/s (one prompt of
``--prompt`` tokens, one output token) and single-stream decode tokens/s (a 16-token
prompt: the time of ``--tokens`` output tokens minus that of one, over ``--tokens - 1``),
each for both engines in float32 and as a ratio (medians of 3 runs, the engines taking
turns run by run). transformers runs its PyTorch fallbacks (no flash-linear-attention on
CPU); tokenmill the scan kernels chosen at load (on CPU the native decode step and the
PyTorch chunked prefill; ``TOKENMILL_SCAN_KERNEL=torch``: the PyTorch reference for both).

Then the time to first token of a second request that shares a ``--shared-prefix``-token
prefix (default 1,000) with a first one: restored from the first request's state snapshot
(``kv_cache/snapshots.py``) vs recomputed (the same engine, the second request with
``reuse_context=False``), the two taking turns round by round, the prefix cache reset
before each round's first request; wall and process CPU time (medians of ``--rounds``).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/hybrid.py --only-ttft --shared-prefix 1000

(On a loaded shared machine, spinning OpenMP threads slow small forwards most: the
restored request's 64 tokens more than the recomputed 1,024.)

``--scan-ab N``: instead, tokenmill alone with its recurrent scans native vs the PyTorch
reference (``TOKENMILL_SCAN_KERNEL``, two engines in one process taking turns run by run):
decode tokens/s of 1 and of N concurrent 16-token prompts, medians of 3 runs.

    python benchmarks/hybrid.py --layers 24 --tokens 16 --scan-ab 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

CONFIG = Path(__file__).parent / "configs" / "qwen3.5-0.8b-shaped.json"


def make_checkpoint(cache: Path, layers: int) -> Path:
    """The random-weight checkpoint (made once per layer count), with a tokenizer."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    target = cache / f"qwen3.5-0.8b-shaped-{layers}l"
    if (target / "model.safetensors").is_file():
        return target
    config = json.loads(CONFIG.read_text())
    config["num_hidden_layers"] = layers
    for key in ("architectures", "model_type"):
        config.pop(key)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**config)).eval()
    model.save_pretrained(target)
    from tokenmill.loader.resolve import default_model_path  # the embedded SmolLM2 tokenizer

    gguf = Path(default_model_path())
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(target)
    return target


def prompt_ids(n: int) -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 40000, (n,), generator=gen).tolist()


def tokenmill_llm(path: Path, longest: int, **options):
    from tokenmill import LLM

    return LLM(str(path), dtype="float32", device="cpu", max_model_len=longest,
               max_num_batched_tokens=max(2048, longest), enable_prefix_caching=False,
               **options)  # fmt: skip


def tokenmill_runner(llm, prompts: int = 1) -> Callable[[list[int], int], object]:
    """run(ids, n): ``prompts`` copies of ids (each one token apart), n output tokens each."""
    from tokenmill import SamplingParams
    from tokenmill.inputs import TokensPrompt

    def run(ids: list[int], n: int) -> object:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=[3 + i, *ids[1:]]) for i in range(prompts)]
        return llm.generate(batch, params, use_tqdm=False)

    return run


def scan_ab(path: Path, args: argparse.Namespace) -> None:
    """Decode tokens/s with the native scans vs the PyTorch reference, 1 and N sequences."""
    start = time.perf_counter()
    prompt = prompt_ids(16)
    llms = {}
    for kernel in ("torch", "native"):
        os.environ["TOKENMILL_SCAN_KERNEL"] = kernel  # read when the engine loads
        llms[kernel] = tokenmill_llm(path, 16 + args.tokens + 8, max_num_seqs=args.scan_ab,
                                     ssm_state_cache_size=args.scan_ab)  # fmt: skip
    os.environ.pop("TOKENMILL_SCAN_KERNEL")
    rows = [["scans", "sequences", "decode tok/s"]]
    for n in sorted({1, args.scan_ab}):
        runners = {kernel: tokenmill_runner(llm, n) for kernel, llm in llms.items()}
        got = {}
        for kernel, (_, one, many) in measure(runners, prompt, args.tokens).items():
            got[kernel] = n * (args.tokens - 1) / (many - one)
            rows.append([kernel, str(n), f"{got[kernel]:.2f}"])
        rows.append(["ratio", str(n), f"{got['native'] / got['torch']:.2f}x"])
    print(f"Qwen3.5-0.8B shapes, {args.layers} layers, float32, {torch.get_num_threads()} "
          f"threads, tokenmill's scans, decode {args.tokens} ({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(table(rows))


def transformers_runner(path: Path, longest: int) -> Callable[[list[int], int], object]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def run(ids: list[int], n: int) -> object:
        with torch.inference_mode():
            return model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)  # fmt: skip

    return run


def measure(runners: dict[str, Callable], prompt: list[int], tokens: int, repeat: int = 3):
    """Per engine (prefill s, one token s, ``tokens`` tokens s), medians; the engines take
    turns run by run, so a load change on the shared machine falls on both."""
    short = prompt[:16]
    cases = {"prefill": (prompt, 1), "one": (short, 1), "many": (short, tokens)}
    for run in runners.values():
        run(prompt, 2)  # warm up
    times: dict[str, dict[str, list[float]]] = {n: {c: [] for c in cases} for n in runners}
    for _ in range(repeat):
        for case, (ids, n) in cases.items():
            for name, run in runners.items():
                start = time.perf_counter()
                run(ids, n)
                times[name][case].append(time.perf_counter() - start)
    return {
        name: tuple(statistics.median(by_case[c]) for c in cases) for name, by_case in times.items()
    }


def ttft(path: Path, shared: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per variant (restored, recomputed): median (wall s, process CPU s) of the second
    request's first token."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=shared + 64,
              max_num_batched_tokens=max(2048, shared + 64),
              context_cache_config={"recurrent_snapshot_pool_bytes": 1 << 30})  # fmt: skip
    prefix = prompt_ids(shared)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[tuple[float, float]]] = {"restored": [], "recomputed": []}
    for r in range(rounds):
        llm.reset_prefix_cache()
        first = prefix + [5 + r] * 16
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        order = ["restored", "recomputed"] if r % 2 == 0 else ["recomputed", "restored"]
        for variant in order:
            tail = [9 + r] * 24 if variant == "restored" else [11 + r] * 24  # not each other's
            second = {"prompt_token_ids": prefix + tail,
                      "reuse_context": variant == "restored"}  # fmt: skip
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate([second], params, use_tqdm=False)
            times[variant].append((time.perf_counter() - wall, time.process_time() - cpu))
    metrics = llm.get_prefix_cache_metrics()
    assert metrics["recurrent_snapshot_restores"] == rounds, metrics
    llm.close()
    return {v: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
            for v, t in times.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens of the decode run")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tokenmill-bench")
    ap.add_argument("--shared-prefix", type=int, default=1000, help="tokens the two share")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the TTFT comparison")
    ap.add_argument("--only-ttft", action="store_true", help="skip prefill / decode")
    ap.add_argument("--scan-ab", type=int, default=0, metavar="N",
                    help="only: native vs reference scans, 1 and N sequences")  # fmt: skip
    args = ap.parse_args()
    start = time.perf_counter()
    path = make_checkpoint(args.cache, args.layers)
    if args.scan_ab:
        scan_ab(path, args)
        return
    if not args.only_ttft:
        throughput(path, args)
    rows = [["second request", "TTFT s (wall)", "TTFT s (CPU)"]]
    result = ttft(path, args.shared_prefix, args.rounds)
    for variant, (wall, cpu) in result.items():
        rows.append([variant, f"{wall:.3f}", f"{cpu:.3f}"])
    (rw, rc), (cw, cc) = result["restored"], result["recomputed"]
    rows.append(["speed-up", f"{cw / rw:.1f}x", f"{cc / rc:.1f}x"])
    print(f"time to first token, {args.shared_prefix}-token shared prefix, {args.rounds} rounds "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(table(rows))


def throughput(path: Path, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    prompt = prompt_ids(args.prompt)
    longest = len(prompt) + args.tokens + 8
    runners = {"tokenmill": tokenmill_runner(tokenmill_llm(path, longest)),
               "transformers": transformers_runner(path, longest)}  # fmt: skip
    rows = [["engine", "prefill tok/s", "decode tok/s"]]
    results = {}
    for name, (prefill, one, many) in measure(runners, prompt, args.tokens).items():
        results[name] = (args.prompt / prefill, (args.tokens - 1) / (many - one))
        rows.append([name, f"{results[name][0]:.1f}", f"{results[name][1]:.2f}"])
    ours, theirs = results["tokenmill"], results["transformers"]
    rows.append(["ratio", f"{ours[0] / theirs[0]:.2f}x", f"{ours[1] / theirs[1]:.2f}x"])
    print(f"Qwen3.5-0.8B shapes, {args.layers} layers, float32, {torch.get_num_threads()} threads, "
          f"prompt {args.prompt}, decode {args.tokens} ({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
