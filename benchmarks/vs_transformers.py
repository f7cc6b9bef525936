"""tokenmill vs Hugging Face transformers on the same weights, side by side in one run.

    python benchmarks/vs_transformers.py [--model PATH.gguf|HF_DIR] [--threads 2]
    python benchmarks/vs_transformers.py --hf16 bf16 --dtypes auto --hf-dtypes float32,auto
    python benchmarks/vs_transformers.py --hf16 bf16 --dtypes auto,auto:low --hf-dtypes auto

Reports single-stream decode tokens/s, prefill tokens/s and aggregate throughput
for concurrent requests of 128 output tokens, each as a ratio to transformers (the
first of ``--hf-dtypes``) and to the memory-bandwidth limit (weight bytes read per
decode step vs a copy bandwidth measured next to each decode run: this VM's bandwidth
moves by 30-60% within minutes, so one sample taken before the runs can be far from what
a run saw; each run is bracketed by two samples and held to the higher, and the median
fraction over the runs is reported). The concurrent throughput is also measured in
back-to-back pairs of runs, tokenmill (its first dtype) and transformers (the base), both
loaded, the order alternating: the median of the pairs' ratios, which a slow spell of the
VM moves far less than the ratio of the two engines' separate measurements (transformers'
bf16 concurrent run read 164-225 tok/s on different days here). Default model: the embedded
SmolLM2-135M (GGUF Q4_1), dequantized to float32 for both engines. ``--hf16 bf16``
(or fp16, fp32) runs an HF folder of the same model saved in that dtype (made once from
the GGUF with transformers, cached under ``--cache``): tokenmill's ``dtype=auto`` keeps its
16-bit weights (float32 ones: the native float32 kernel where it beats MKL,
``TOKENMILL_FP32_GEMM``); transformers' ``auto`` runs them as stored, ``float32`` upcast.
A tokenmill dtype may carry an activation precision: ``auto:low`` is ``dtype="auto",
activation_precision="low"`` (one activation term: bfloat16 ones for bf16 weights, as
transformers' bf16 computes; one int8 term for GGUF weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, copy_bandwidth, decode_runs, table  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def load_hf(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    p, dt = Path(path), dtype if dtype == "auto" else getattr(torch, dtype)
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=dt
        ).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()


def make_hf16(gguf: str, dtype: str, cache: Path) -> str:
    """An HF folder of the GGUF's model with its weights in ``dtype`` (made once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache / f"{Path(gguf).stem}-{dtype}"
    if (target / "model.safetensors").is_file():
        return str(target)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    g = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name)
    if hasattr(model.config, "quantization_config"):  # GGUF-loaded models refuse to save
        del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=dt)
    plain.load_state_dict({k: v.to(dt) for k, v in model.state_dict().items()})
    plain.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(target)
    return str(target)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, as stored (dense, 16-bit tiles, int groups):
    every linear, the embedding table only when it is also the output head (tied)."""
    from tokenmill.layers.linear import Linear, VocabEmbedding

    tied = not any(
        isinstance(m, Linear) and n.endswith("lm_head") for n, m in model.named_modules()
    )
    total, seen = 0, set()
    for name, m in model.named_modules():
        if isinstance(m, (Linear, VocabEmbedding)):
            seen.update(f"{name}.{p}" for p, _ in m.named_parameters(recurse=False))
            if isinstance(m, Linear) or tied:
                total += m.method.weight_bytes(m)
    return total + sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n not in seen
    )


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def tm_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> int:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return sum(len(o.outputs[0].token_ids) for o in outs)


@torch.inference_mode()
def hf_run(model, prompts: list[list[int]], max_tokens: int) -> int:
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def decode_runs_of(run, model, args, probe=None) -> tuple[list[float], list[float]]:
    """``common.decode_runs`` of ``run`` on ``model`` from a 32-token prompt."""
    short = [prompt_ids(32, 1)]
    return decode_runs(lambda k: run(model, short, k), args.decode_tokens, args.repeat, probe)


def prefill_rate(run, model, args) -> float:
    long = [prompt_ids(args.prefill_len, 2)]
    return args.prefill_len / best_of(lambda: run(model, long, 1), args.repeat)


def run_transformers(
    path: str, dtype: str, args, prompts: list[list[int]], n_out: int
) -> dict[str, float]:
    hf = load_hf(path, dtype)
    rates, _ = decode_runs_of(hf_run, hf, args)
    res = {"decode": statistics.median(rates), "prefill": prefill_rate(hf_run, hf, args)}
    res["agg"] = len(prompts) * n_out / best_of(lambda: hf_run(hf, prompts, n_out), args.repeat)
    return res


def open_tokenmill(path: str, dtype: str) -> LLM:
    """tokenmill on ``path`` with ``dtype`` (``auto:low``: with activation_precision="low"),
    without prefix caching: measure compute, not cache hits."""
    dtype, _, precision = dtype.partition(":")
    options = {"activation_precision": precision} if precision else {}
    return LLM(path, dtype=dtype, enable_prefix_caching=False, **options)


def run_tokenmill(path: str, dtype: str, args, prompts: list[list[int]], n_out: int) -> dict:
    with open_tokenmill(path, dtype) as llm:
        wbytes = decode_weight_bytes(llm.engine.loaded.model)
        res: dict = {"prefill": prefill_rate(tm_run, llm, args)}
        # each run held to the copy bandwidth sampled around it (the VM's moves in minutes)
        rates, bandwidths = decode_runs_of(tm_run, llm, args, probe=copy_bandwidth)
        limits = [bw / wbytes for bw in bandwidths]
        res["decode"], res["limit"] = statistics.median(rates), statistics.median(limits)
        res["fractions"] = sorted(r / lim for r, lim in zip(rates, limits))
        res["format"] = f"{llm.engine.loaded.quantization}/{str(llm.engine.loaded.dtype)[6:]}"
        res["agg"] = (
            len(prompts) * n_out / best_of(lambda: tm_run(llm, prompts, n_out), args.repeat)
        )
    res["wbytes"] = wbytes
    return res


def paired_concurrent(
    path: str, hf_dtype: str, tm_dtype: str, args, same: list[list[int]],
    varied: list[list[int]], n_out: int,
) -> list[float]:  # fmt: skip
    """tokenmill's concurrent rate over transformers' in back-to-back pairs, both engines
    loaded, the order alternating: a slow spell of the VM then falls on both sides of a
    ratio instead of on one engine's whole measurement."""
    hf = load_hf(path, hf_dtype)
    ratios = []
    with open_tokenmill(path, tm_dtype) as llm:
        tm_run(llm, varied[:2], 4)  # warm-up
        runs = {"hf": lambda: hf_run(hf, same, n_out), "tm": lambda: tm_run(llm, varied, n_out)}
        for r in range(args.repeat):
            seconds = {}
            for name in ("hf", "tm") if r % 2 == 0 else ("tm", "hf"):
                start = time.perf_counter()
                runs[name]()
                seconds[name] = time.perf_counter() - start
            ratios.append(seconds["hf"] / seconds["tm"])  # the same 32 x n_out tokens each
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="tokenmill dtypes to run (comma list; dtype:low adds activation_precision=low)",
    )
    ap.add_argument(
        "--hf-dtypes",
        default="float32",
        help="transformers dtypes (comma list; auto = as stored); the first is the ratios' base",
    )
    ap.add_argument(
        "--hf16",
        choices=("bf16", "fp16", "fp32"),
        help="run an HF folder of --model saved in this dtype (fp32: float32 weights)",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "tokenmill-bench",
        help="where --hf16 folders are kept",
    )
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.loader import default_model_path

    path = str(args.model or default_model_path())
    if args.hf16:
        path = make_hf16(path, args.hf16, args.cache)
    c, n_out = args.concurrency, 128
    varied = [prompt_ids(16 + (i * 37) % 96, 100 + i) for i in range(c)]
    same = [prompt_ids(64, 100 + i) for i in range(c)]

    peers = {d: run_transformers(path, d, args, same, n_out) for d in args.hf_dtypes.split(",")}
    ref = next(iter(peers.values()))
    results = {d: run_tokenmill(path, d, args, varied, n_out) for d in args.dtypes.split(",")}

    print(f"model: {path}; torch threads {torch.get_num_threads()}")
    print(
        "bandwidth limit: copy bandwidth (read + write) sampled around each decode run / "
        f"weight bytes per step; ratios vs transformers {next(iter(peers))}"
    )
    rows = [
        ["metric"]
        + [f"transformers {d}" for d in peers]
        + [f"tokenmill {d} ({r['format']})" for d, r in results.items()]
    ]
    rows.append(
        ["single-stream decode tok/s"]
        + [f"{p['decode']:.1f}" for p in peers.values()]
        + [
            f"{r['decode']:.1f} ({r['decode'] / ref['decode']:.2f}x; "
            f"{statistics.median(r['fractions']):.0%} of bw limit {r['limit']:.0f}, runs "
            f"{'/'.join(f'{f:.0%}' for f in r['fractions'])})"
            for r in results.values()
        ]
    )
    rows.append(
        [f"prefill tok/s ({args.prefill_len}-token prompt)"]
        + [f"{p['prefill']:.0f}" for p in peers.values()]
        + [f"{r['prefill']:.0f} ({r['prefill'] / ref['prefill']:.2f}x)" for r in results.values()]
    )
    rows.append(
        [f"{c} concurrent x {n_out} out, tok/s"]
        + [f"{p['agg']:.0f}" for p in peers.values()]
        + [f"{r['agg']:.0f} ({r['agg'] / ref['agg']:.2f}x)" for r in results.values()]
    )
    paired = paired_concurrent(
        path, next(iter(peers)), next(iter(results)), args, same, varied, n_out
    )
    runs = "/".join(f"{x:.2f}" for x in paired)
    rows.append(
        [f"{c} concurrent, paired runs (ratio)"]
        + [""] * len(peers)
        + [f"{statistics.median(paired):.2f}x (runs {runs})"]
        + [""] * (len(results) - 1)
    )
    print(table(rows))
    print(
        "weights read per decode step: "
        + ", ".join(f"{d} {r['wbytes'] / 1e6:.0f} MB" for d, r in results.items())
    )
    print(
        "(transformers' concurrent run is one batched generate over equal-length 64-token prompts; "
        "tokenmill's prompts have different lengths, 16-111 tokens, scheduled continuously)"
    )


if __name__ == "__main__":
    main()
