"""tokenmill vs Hugging Face transformers on the same weights, side by side in one run.

    python benchmarks/vs_transformers.py [--model PATH.gguf|HF_DIR] [--threads 2]

Reports single-stream decode tokens/s, prefill tokens/s and aggregate throughput
for concurrent requests of 128 output tokens, each as a ratio to transformers
and to the memory-bandwidth limit (weight bytes read per decode step vs a copy
bandwidth measured in this run). Default model: the embedded SmolLM2-135M
(GGUF Q4_1), dequantized to float32 for both engines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, copy_bandwidth, table, weight_bytes_per_decode_step  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def load_hf(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0]


def measure(run, model, args) -> dict[str, float]:
    short = [prompt_ids(32, 1)]
    n = args.decode_tokens
    t_first = best_of(lambda: run(model, short, 1), args.repeat)
    t_all = best_of(lambda: run(model, short, n), args.repeat)
    long = [prompt_ids(args.prefill_len, 2)]
    t_prefill = best_of(lambda: run(model, long, 1), args.repeat)
    return {
        "decode": (n - 1) / (t_all - t_first),
        "prefill": args.prefill_len / t_prefill,
    }


def run_transformers(path: str, args, prompts: list[list[int]], n_out: int) -> dict[str, float]:
    hf = load_hf(path)
    res = measure(hf_run, hf, args)
    res["agg"] = len(prompts) * n_out / best_of(lambda: hf_run(hf, prompts, n_out), 1)
    return res


def run_tokenmill(path: str, dtype: str, args, prompts: list[list[int]], n_out: int, bw: float) -> dict[str, float]:
    with LLM(path, dtype=dtype, enable_prefix_caching=False) as llm:  # measure compute, not cache hits
        arch = llm.engine.loaded.checkpoint.hf_config
        wbytes = weight_bytes_per_decode_step(llm.engine.loaded.model, arch["vocab_size"], arch["hidden_size"])
        res = measure(tm_run, llm, args)
        res["agg"] = len(prompts) * n_out / best_of(lambda: tm_run(llm, prompts, n_out), 1)
    res["limit"] = bw / wbytes
    res["wbytes"] = wbytes
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="tokenmill dtypes to run (comma list)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.loader import default_model_path

    path = args.model or default_model_path()
    c, n_out = args.concurrency, 128
    varied = [prompt_ids(16 + (i * 37) % 96, 100 + i) for i in range(c)]
    same = [prompt_ids(64, 100 + i) for i in range(c)]

    ref = run_transformers(path, args, same, n_out)
    bw = copy_bandwidth()
    results = {d: run_tokenmill(path, d, args, varied, n_out, bw) for d in args.dtypes.split(",")}

    print(f"model: {path}; torch threads {torch.get_num_threads()}")
    print(f"copy bandwidth (read + write) {bw / 1e9:.1f} GB/s")
    rows = [["metric", "transformers fp32"] + [f"tokenmill {d}" for d in results]]
    rows.append(["single-stream decode tok/s", f"{ref['decode']:.1f}"] + [
        f"{r['decode']:.1f} ({r['decode'] / ref['decode']:.2f}x; {r['decode'] / r['limit']:.0%} of bw limit {r['limit']:.0f})"
        for r in results.values()])
    rows.append([f"prefill tok/s ({args.prefill_len}-token prompt)", f"{ref['prefill']:.0f}"] + [
        f"{r['prefill']:.0f} ({r['prefill'] / ref['prefill']:.2f}x)" for r in results.values()])
    rows.append([f"{c} concurrent x {n_out} out, tok/s", f"{ref['agg']:.0f}"] + [
        f"{r['agg']:.0f} ({r['agg'] / ref['agg']:.2f}x)" for r in results.values()])
    print(table(rows))
    print("weights read per decode step: " + ", ".join(f"{d} {r['wbytes'] / 1e6:.0f} MB" for d, r in results.items()))
    print("(transformers' concurrent run is one batched generate over equal-length 64-token prompts; "
          "tokenmill's prompts have different lengths, 16-111 tokens, scheduled continuously)")


if __name__ == "__main__":
    main()
