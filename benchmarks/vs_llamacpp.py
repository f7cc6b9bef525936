"""tokenmill vs llama.cpp (llama-cpp-python) on the same GGUF, side by side in one run.

    python benchmarks/vs_llamacpp.py [--model PATH.gguf] [--threads 2]
                                     [--quantization auto,none] [--no-server]
    python benchmarks/vs_llamacpp.py --f16 --no-server

Offline (llama.cpp in a fresh process of its own first, then tokenmill in this one):
single-stream decode tokens/s (128 tokens after a 32-token prompt), prefill tokens/s (32-
and 200-token prompts), load time and, for tokenmill, the peak resident memory of loading
the weights against their in-memory size and the decode rate's fraction of the bandwidth
limit (each decode run held to the copy bandwidth sampled right before and after it, the
medians reported: this VM's moves by 30-60% within minutes). Online
(each server in its own process, as deployed): 16 concurrent requests (128-token
prompts, 64 greedy output tokens each, EOS suppressed) against `tokenmill serve` and
llama-cpp-python's server; reported as output tokens/s. Every tokenmill figure is
also given as a ratio to llama.cpp's. Without llama-cpp-python the peer is skipped
with a message and tokenmill's figures are printed alone.
Default model: the embedded SmolLM2-135M-Instruct Q4_1.

``--f16``: 16-bit weights on both sides. llama.cpp runs an F16 GGUF of the model (its
tensors dequantized with the gguf package, norms kept F32, metadata copied; made once
under ``--cache``) and tokenmill the HF folder of the same weights in bfloat16 that
``vs_transformers.py --hf16 bf16`` makes (``quantization=auto`` keeps it in 16 bits); the
server run is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, decode_runs, in_fresh_process, table  # noqa: E402
from llama_server import NO_EXTRA_BUFTS, start_llama_cpp  # noqa: E402

DECODE_PROMPT, PREFILL_LENS = 32, (32, 200)


def fastest(fn, repeat: int) -> float:
    """Shortest wall time of fn() over ``repeat`` runs: on a shared machine other processes
    only ever add time, so the minimum is the closest to what the code itself costs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def prompt_ids(n: int, seed: int, vocab: int = 20000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def make_f16_gguf(src: str, cache: Path) -> str:
    """An F16 copy of the GGUF ``src``: every 2-D tensor dequantized to float16, 1-D ones
    (norms) float32, the metadata as it was. Made once under ``cache``."""
    import gguf
    import numpy as np

    target = cache / f"{Path(src).stem}-F16.gguf"
    if target.is_file():
        return str(target)
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE):
            continue  # written below
        if field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # [..., ne0] float32
        writer.add_tensor(t.name, values.astype(np.float16 if values.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    return str(target)


# -- tokenmill -----------------------------------------------------------------------
def tm_generate(llm, prompt: list[int], n: int) -> None:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params)


def tm_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer except the rotary tables (weights, quantized or not)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return sum(t.numel() * t.element_size() for n, t in tensors if "_cache" not in n)


def tm_decode_weight_bytes(model: torch.nn.Module) -> int:
    """What one decode step reads: every weight but the embedding rows (unless tied)."""
    total = tm_weight_bytes(model)
    embed = model.model.embed_tokens
    if getattr(model, "lm_head", None) is not None:
        total -= embed.method.weight_bytes(embed)
    return total


LOAD_MEMORY = """
import sys, time
from pathlib import Path
def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
from tokenmill.config import EngineConfig
from tokenmill.engine.loading import load_model
from tokenmill.loader import load_checkpoint
from tokenmill import native
from tokenmill.tokenizer import load_tokenizer
config = EngineConfig(model=sys.argv[1], quantization=sys.argv[2])
load_tokenizer(load_checkpoint(config.model), None)  # imports and tokenizer cache warm
native.available()
Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
before = rss("VmRSS:")
start = time.perf_counter()
loaded = load_model(config)
seconds = time.perf_counter() - start
tensors = [*loaded.model.named_parameters(), *loaded.model.named_buffers()]
weights = sum(t.numel() * t.element_size() for n, t in tensors if "_cache" not in n)
print(seconds, rss("VmHWM:") - before, weights)
"""


def load_memory(path: str, quantization: str) -> tuple[float, int, int]:
    """(seconds, peak resident bytes added by load_model, the model's weight bytes), measured
    in a fresh process so that nothing else this benchmark allocated counts."""
    import subprocess

    cmd = [sys.executable, "-c", LOAD_MEMORY, path, quantization]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1]), int(out[2])


def run_tokenmill(path: str, quantization: str, repeat: int, n: int) -> dict[str, float]:
    from tokenmill import LLM

    res: dict[str, float] = {}
    res["load_s"], res["load_peak"], res["weights"] = load_memory(path, quantization)
    with LLM(path, quantization=quantization, enable_prefix_caching=False) as llm:
        loaded = llm.engine.loaded
        res["label"] = f"{loaded.quantization}, {str(loaded.dtype).removeprefix('torch.')}"
        res["decode_bytes"] = tm_decode_weight_bytes(loaded.model)
        short = prompt_ids(DECODE_PROMPT, 1)
        tm_generate(llm, short, 8)  # warm-up
        rates, bandwidths = decode_runs(
            lambda k: tm_generate(llm, short, k), n, repeat, probe=copy_bandwidth
        )
        res["decode"], res["bw"] = statistics.median(rates), statistics.median(bandwidths)
        for length in PREFILL_LENS:
            p = prompt_ids(length, 2)
            res[f"prefill{length}"] = length / fastest(lambda p=p: tm_generate(llm, p, 1), repeat)
    return res


def run_llama_cpp(
    path: str, threads: int, repeat: int, n: int, extra_bufts: bool
) -> dict[str, float]:
    if not extra_bufts:
        exec(NO_EXTRA_BUFTS, {})
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(
        model_path=path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    res: dict[str, float] = {"load_s": time.perf_counter() - start, "label": "llama.cpp"}

    def generate(prompt: list[int], count: int) -> None:
        llm.reset()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
            if i == count:
                break

    def prefill(prompt: list[int]) -> None:
        llm.reset()
        llm.eval(prompt)

    short = prompt_ids(DECODE_PROMPT, 1)
    generate(short, 8)
    res["decode"] = statistics.median(decode_runs(lambda k: generate(short, k), n, repeat)[0])
    for length in PREFILL_LENS:
        p = prompt_ids(length, 2)
        res[f"prefill{length}"] = length / fastest(lambda p=p: prefill(p), repeat)
    llm.close()
    return res


# -- online: 16 concurrent requests ---------------------------------------------------


def run_servers(path: str, args, have_peer: bool, threads: int) -> dict[str, float]:
    import httpx
    from serving import Target, free_port, random_prompts, run_level, start_tokenmill, stop
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    c = args.concurrency
    prompts = random_prompts(tok, c, args.prompt_len, seed=7)
    out: dict[str, float] = {}

    port = free_port()
    proc = start_tokenmill(path, port)
    try:
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        target = Target(
            "tokenmill", f"http://127.0.0.1:{port}/v1", name, {"ignore_eos": True}, True
        )
        asyncio.run(run_level(target, prompts[:1], 1, 4))  # warm-up
        out["tokenmill"] = max(  # best of two rounds: other processes only ever slow a round
            asyncio.run(run_level(target, prompts, c, args.max_tokens)).tokens_per_s
            for _ in range(2)
        )
    finally:
        stop(proc)
    if have_peer:
        port = free_port()
        n_ctx = args.prompt_len + args.max_tokens + 64
        proc = start_llama_cpp(path, port, n_ctx, threads, args.llama_extra_bufts)
        try:
            eos = {str(tok.eos_token_id): -100.0}  # like ignore_eos: every request makes max_tokens
            target = Target(
                "llama.cpp", f"http://127.0.0.1:{port}/v1", path, {"logit_bias": eos}, False
            )
            texts = [tok.decode(p) for p in prompts]
            asyncio.run(run_level(target, texts[:1], 1, 4))
            out["llama.cpp"] = asyncio.run(
                run_level(target, texts, c, args.max_tokens)
            ).tokens_per_s
        finally:
            stop(proc)
    return out


def ratio(tm: float, peer: dict | None, key: str) -> str:
    return f"{tm:.1f}" + (f" ({tm / peer[key]:.2f}x)" if peer else "")


def report(results: dict[str, dict], peer: dict | None, online: dict, args) -> None:
    cols = list(results)
    rows = [["metric"] + (["llama.cpp"] if peer else []) + [f"tokenmill {c}" for c in cols]]
    for key, name in [
        ("decode", f"decode tok/s (1 stream, {args.decode_tokens} tokens)"),
        *[(f"prefill{n}", f"prefill tok/s ({n}-token prompt)") for n in PREFILL_LENS],
        ("load_s", "load seconds"),
    ]:
        rows.append(
            [name]
            + ([f"{peer[key]:.1f}"] if peer else [])
            + [
                f"{results[c][key]:.1f}" if key == "load_s" else ratio(results[c][key], peer, key)
                for c in cols
            ]
        )
    rows.append(
        ["decode % of bandwidth limit"]
        + ([""] if peer else [])
        + [
            f"{r['decode'] * r['decode_bytes'] / r['bw']:.0%} (limit "
            f"{r['bw'] / r['decode_bytes']:.0f}/s at {r['bw'] / 1e9:.1f} GB/s copy)"
            for r in results.values()
        ]
    )
    rows.append(
        ["weights MB (load peak MB)"]
        + ([""] if peer else [])
        + [
            f"{r['weights'] / 1e6:.0f} ({r['load_peak'] / 1e6:.0f}, {r['load_peak'] / r['weights']:.2f}x)"
            for r in results.values()
        ]
    )
    print(table(rows))
    if online:
        print(
            f"\n{args.concurrency} concurrent requests ({args.prompt_len}-token prompts, "
            f"{args.max_tokens} output tokens), server output tokens/s:"
        )
        line = [f"tokenmill {online['tokenmill']:.1f}"]
        if "llama.cpp" in online:
            line.append(f"llama.cpp {online['llama.cpp']:.1f}")
            line.append(f"ratio {online['tokenmill'] / online['llama.cpp']:.2f}x")
        print("  " + ", ".join(line))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: torch's)")
    ap.add_argument(
        "--quantization", default="auto", help="tokenmill quantizations to run (comma list)"
    )
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-server", action="store_true", help="skip the 16-concurrent server run")
    ap.add_argument(
        "--f16",
        action="store_true",
        help="16-bit weights: llama.cpp on an F16 GGUF, tokenmill on the bf16 HF folder",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "tokenmill-bench",
        help="where --f16 files are kept",
    )
    ap.add_argument(
        "--llama-extra-bufts",
        action="store_true",
        help="keep llama.cpp's extra CPU buffer types (AMX; SIGILL on some VMs)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    from tokenmill.loader import default_model_path

    path = peer_path = str(args.model or default_model_path())
    if args.f16:
        from vs_transformers import make_hf16

        peer_path = make_f16_gguf(path, args.cache)
        path = make_hf16(path, "bf16", args.cache)
        args.no_server = True
    have_peer = importlib.util.find_spec("llama_cpp") is not None
    print(f"model: {path}; llama.cpp: {peer_path}; {threads} threads", flush=True)
    peer = None
    if have_peer:
        peer = in_fresh_process(  # its thread pool stays out of tokenmill's process
            run_llama_cpp, peer_path, threads, args.repeat, args.decode_tokens,
            args.llama_extra_bufts,
        )  # fmt: skip
    else:
        print(
            "llama.cpp: skipped (llama-cpp-python is not installed; `pip install "
            "'llama-cpp-python[server]'` builds it to compare on the same GGUF)"
        )
    results = {
        q: run_tokenmill(path, q, args.repeat, args.decode_tokens)
        for q in args.quantization.split(",")
    }
    results = {r["label"]: r for r in results.values()}
    online = {} if args.no_server else run_servers(path, args, have_peer, threads)
    print(
        "bandwidth limit: weight bytes per decode step against the copy bandwidth (read +"
        " write) sampled around each of tokenmill's decode runs (the higher of the two; medians)\n"
    )
    report(results, peer, online, args)


if __name__ == "__main__":
    main()
