"""tokenmill on one GPU against the hardware limits and transformers, in one run.

    python benchmarks/gpu_suite.py --out gpu.json                 # Llama 3.2 1B and 3.1 8B shapes
    python benchmarks/gpu_suite.py --shape 1b --no-transformers
    python benchmarks/gpu_suite.py --quick --device cpu           # tiny smoke run (CPU, < 2 min)

Measures the copy bandwidth and the bf16 matmul rate, then per shape (random weights
made on the device, same weights for both engines): decode latency at batch 1 against the
bandwidth limit (weights + KV read per step), prefill tokens/s against the FLOP/s limit,
offline throughput of 64 x (512 in, 128 out) and 256 x (512 in, 256 out) with ignore_eos
against transformers ``generate`` (bf16, sdpa) and the roofline time (the larger one
also with asynchronous scheduling off, ``_sync``), the CUDA graph
capture time, and the load time from safetensors (1B). Every stage reports its error and
the run goes on; ``--time-budget`` skips what would start after it.

Before any timed stage an untimed warm-up (``tm_warmup``) runs every kind of step the
timed workloads meet (prefill-only, mixed prefill + decode with a chunked prompt,
all-decode; odd and even batch sizes and token counts) through the same engine: on a GPU
each new Triton kernel variant is a compile of about a second, which must not land inside
a timed stage. On CUDA each stage also reports ``new_variants``, the Triton kernel
variants compiled while it ran (after the warm-up, a timed stage should show 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402
from gpu_models import (  # noqa: E402
    build_hf,
    build_tokenmill,
    free,
    save_safetensors,
    shape_config,
    write_folder,
)
from gpu_roofline import Shape  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """Workload sizes: the full run, or tiny ones for --quick."""

    b1_prompt: int = 128
    b1_tokens: int = 128
    prefill: tuple[int, int] = (64, 512)
    offline: tuple[tuple[int, int, int], ...] = ((64, 512, 128), (256, 512, 256))
    matmul_n: int = 8192
    copy_mib: int = 2048


QUICK = Sizes(16, 8, (4, 32), ((4, 32, 8), (8, 32, 16)), 256, 32)


@dataclass
class Run:
    args: argparse.Namespace
    device: torch.device
    sizes: Sizes
    deadline: float
    results: dict = field(default_factory=dict)

    def stage(self, where: dict, name: str, fn, *a, **kw):
        """Run one stage: its result (a dict) or its error goes into ``where[name]``."""
        if time.perf_counter() > self.deadline:
            where[name] = {"skipped": "time budget"}
            print(f"[{name}] skipped: over --time-budget", flush=True)
            return None
        print(f"[{name}] ...", flush=True)
        start = time.perf_counter()
        variants = triton_variants()
        try:
            out = fn(*a, **kw)
        except Exception as e:  # a failing stage must not end the run
            traceback.print_exc()
            where[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.save()
            return None
        if isinstance(out, dict):
            if self.device.type == "cuda" and "new_variants" not in out:
                out["new_variants"] = triton_variants() - variants
            where[name] = out
            print(f"[{name}] {time.perf_counter() - start:.1f} s: {_short(out)}", flush=True)
        self.save()
        return out

    def save(self) -> None:
        """Write what is measured so far (a later kill or crash keeps it)."""
        if self.args.out:
            self.args.out.write_text(json.dumps(self.results, indent=2, default=str))


def triton_variants() -> int:
    """Kernel variants Triton has compiled so far for tokenmill's kernels in this process
    (0 where none were: CPU, interpreter, kernels not imported yet)."""
    total = 0
    for module in ("tokenmill.attention.triton_kernels", "tokenmill.layers.triton_ops"):
        for obj in getattr(sys.modules.get(module), "__dict__", {}).values():
            caches = getattr(obj, "device_caches", None)  # a JITFunction: device -> caches
            if isinstance(caches, dict):
                try:
                    total += sum(len(c[0]) for c in caches.values())  # c[0]: key -> kernel
                except (TypeError, IndexError):  # Triton internals (3.9's) moved: no count
                    return -1
    return total


def _short(d: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


# -- hardware -------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int) -> dict:
    """Bytes read + written per second by a device-to-device copy (STREAM's convention)."""
    src = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    n = 10
    seconds = timed(device, lambda: [dst.copy_(src) for _ in range(n)]) / n
    return {"bytes_per_s": 2 * src.numel() * 2 / seconds, "gib": mib / 1024}


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> dict:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 10
    seconds = timed(device, lambda: [a @ b for _ in range(reps)]) / reps
    return {"flops_per_s": 2.0 * n**3 / seconds, "n": n, "dtype": str(dtype)}


# -- tokenmill ------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 1, (n, length), generator=g).tolist()


def engine_config(run: Run, folder: Path, shape: Shape, enforce_eager: bool, kv_tokens: int):
    from tokenmill.config import EngineConfig

    return EngineConfig(
        model=str(folder),
        dtype=run.args.dtype,
        device=str(run.device),
        attention_backend=run.args.attention_backend,
        max_model_len=run.args.max_model_len,
        max_num_seqs=max(n for n, _, _ in run.sizes.offline),
        max_num_batched_tokens=run.args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(kv_tokens * shape.kv_bytes_per_token * 1.1),
        enable_prefix_caching=False,
        enforce_eager=enforce_eager or run.args.enforce_eager,
        async_scheduling=run.args.async_scheduling,
    )


def generate(engine, batch: list[list[int]], max_tokens: int) -> int:
    """Run requests to the end through the engine loop; returns the output tokens."""
    from tokenmill import SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    for p in batch:
        engine.add_request(p, params)
    produced = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    return produced


def tm_warmup(run: Run, engine, shape: Shape) -> dict:
    """Untimed, through the engine the timed stages use: every kind of step they meet, so
    each Triton variant they need is compiled now, not inside a timed stage.

    1. Staggered: one request enters per step (prompt lengths odd and even, one token to a
       full offline prompt), each decoding a few tokens: steps mix one prefill with the
       decodes of the earlier requests at batch sizes rising and falling (odd and even),
       and end with all-decode steps.
    2. Burst: more prompt tokens at once than a step's budget (max_num_batched_tokens), at
       the offline prompt length less one: a prefill-only step with a chunked last
       prompt, then a mixed step (decodes + the rest of it + more prompts), then decodes.
    Returns the seconds and what ran: steps by kind, batch sizes."""
    from tokenmill import SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    start = time.perf_counter()
    p = max(p for _, p, _ in run.sizes.offline)
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    kinds = {"prefill": 0, "mixed": 0, "decode": 0, "chunked": 0}  # chunked: also counted above
    batches: set[int] = set()
    launch = engine.runner.launch

    def spy(sched):
        decodes = sum(s.start >= s.request.num_prompt_tokens for s in sched.seqs)
        kind = "decode" if decodes == len(sched.seqs) else "mixed" if decodes else "prefill"
        kinds[kind] += 1
        kinds["chunked"] += any(s.end < s.request.num_prompt_tokens for s in sched.seqs)
        batches.add(len(sched.seqs))
        return launch(sched)

    engine.runner.launch = spy  # an instance attribute over the method, removed below
    try:
        lengths = [p - 1, p, 1, p // 2 + 1, 18, 3, p // 4]
        staggered = prompts(len(lengths), p, shape.vocab, 11)
        pending = [ids[:n] for ids, n in zip(staggered, lengths)]
        while pending or engine.has_unfinished():
            if pending:
                engine.add_request(pending.pop(0), params)
            engine.step()
        budget = run.args.max_num_batched_tokens
        max_seqs = max(n for n, _, _ in run.sizes.offline)
        burst = min(budget // (p - 1) + 3, max_seqs + 3)
        generate(engine, prompts(burst, p - 1, shape.vocab, 12), 3)
        sync(run.device)
    finally:
        del engine.runner.launch
    return {"seconds": time.perf_counter() - start, "burst": burst,
            **{f"{k}_steps": v for k, v in kinds.items()},
            "batch_sizes": f"{min(batches)}..{max(batches)} ({len(batches)})"}  # fmt: skip


def tm_decode_b1(run: Run, engine, shape: Shape, rates: dict) -> dict:
    s = run.sizes
    p = prompts(1, s.b1_prompt, shape.vocab, 1)
    generate(engine, p, s.b1_tokens + 1)  # warm-up
    t1 = min(timed(run.device, lambda: generate(engine, p, 1)) for _ in range(3))
    tn = min(timed(run.device, lambda: generate(engine, p, s.b1_tokens + 1)) for _ in range(3))
    per_token = (tn - t1) / s.b1_tokens
    out = {"ms_per_token": per_token * 1e3, "tokens_per_s": 1 / per_token}
    if rates.get("bytes_per_s"):
        _, nbytes = shape.decode_step(1, s.b1_prompt + s.b1_tokens // 2)
        bound = nbytes / rates["bytes_per_s"]
        out |= {"bound_ms": bound * 1e3, "of_bound": bound / per_token}
    return out


def profile_decode_b1(run: Run, engine, shape: Shape, top: int = 15) -> dict:
    """Where a batch-1 decode step's device time goes (torch.profiler, eager engine so
    every kernel is seen): the top kernels by self device time per step (CPU ops' self
    time on CPU), and the total per step against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    p = prompts(1, run.sizes.b1_prompt, shape.vocab, 1)
    generate(engine, p, 9)  # warm-up
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if run.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        wall = timed(run.device, lambda: generate(engine, p, 9))
    events = list(prof.key_averages())
    attr = "self_cpu_time_total"  # self times: a parent op does not count its kernels again
    if run.device.type == "cuda":
        attr = next(
            a for a in ("self_device_time_total", "self_cuda_time_total") if hasattr(events[0], a)
        )
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total_us = sum(getattr(e, attr) for e in events)
    kernels = [(e.key[:80], e.count, round(getattr(e, attr) / 9, 1)) for e in events[:top]]
    for name, count, us in kernels:
        print(f"  {us:9.1f} us/step  x{count:<6} {name}", flush=True)
    return {"device_us_per_step": total_us / 9, "wall_us_per_step": wall / 9 * 1e6,
            "top_kernels_us_per_step": kernels}  # fmt: skip


def tm_prefill(run: Run, engine, shape: Shape, rates: dict) -> dict:
    n, length = run.sizes.prefill
    batch = prompts(n, length, shape.vocab, 2)
    generate(engine, batch[:2], 1)  # warm-up
    seconds = timed(run.device, lambda: generate(engine, batch, 1))
    out = {"tokens_per_s": n * length / seconds, "seconds": seconds}
    if rates.get("flops_per_s"):
        limit = shape.prefill_flops([length] * n) / rates["flops_per_s"]
        out |= {"limit_tokens_per_s": n * length / limit, "of_limit": limit / seconds}
    return out


def tm_offline(run: Run, engine, shape: Shape, rates: dict, n: int, p: int, o: int) -> dict:
    batch = prompts(n, p, shape.vocab, 3)
    produced = 0

    def go():
        nonlocal produced
        produced = generate(engine, batch, o)

    seconds = timed(run.device, go)
    out = {"seconds": seconds, "out_tokens_per_s": produced / seconds, "tokens": produced}
    if rates.get("flops_per_s") and rates.get("bytes_per_s"):
        roof = shape.offline_seconds(n, p, o, rates["flops_per_s"], rates["bytes_per_s"])
        out |= {"roofline_seconds": roof, "of_roofline": roof / seconds}
    return out


def graph_info(engine) -> dict:
    decode = engine.runner.decode
    backend = getattr(engine.runner.backend, "name", str(engine.runner.backend))
    if decode is None:
        return {"graphs": False, "backend": backend}
    return {"graphs": True, "backend": backend, "buckets": len(decode.graphs),
            "capture_s": sum(decode.capture_seconds.values())}  # fmt: skip


# -- transformers ---------------------------------------------------------------------
@torch.inference_mode()
def hf_generate(
    model, batch: list[list[int]], max_tokens: int, device: torch.device
) -> tuple[float, int]:
    """Seconds for all of ``batch``; on out-of-memory the batch is halved and run in chunks.
    Returns (seconds, chunk size used)."""
    chunk = len(batch)
    while True:
        try:
            total = 0.0
            for i in range(0, len(batch), chunk):
                ids = torch.tensor(batch[i : i + chunk], device=device)  # equal lengths
                total += timed(device, lambda ids=ids: model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                ))  # fmt: skip
            return total, chunk
        except torch.OutOfMemoryError:
            free()
            if chunk == 1:
                raise
            chunk //= 2
            print(f"  transformers ran out of memory: batch {chunk * 2} -> {chunk}", flush=True)


def hf_decode_b1(run: Run, model, shape: Shape) -> dict:
    s = run.sizes
    p = prompts(1, s.b1_prompt, shape.vocab, 1)
    hf_generate(model, p, 2, run.device)  # warm-up
    t1 = min(hf_generate(model, p, 1, run.device)[0] for _ in range(3))
    tn = min(hf_generate(model, p, s.b1_tokens + 1, run.device)[0] for _ in range(2))
    per_token = (tn - t1) / s.b1_tokens
    return {"ms_per_token": per_token * 1e3, "tokens_per_s": 1 / per_token}


def hf_offline(run: Run, model, shape: Shape, n: int, p: int, o: int) -> dict:
    seconds, chunk = hf_generate(model, prompts(n, p, shape.vocab, 3), o, run.device)
    return {"seconds": seconds, "out_tokens_per_s": n * o / seconds, "batch": chunk}


# -- one shape ------------------------------------------------------------------------
def run_shape(run: Run, name: str, rates: dict, res: dict) -> None:
    """Every stage of one shape; results go into ``res`` as they come (partial on a crash)."""
    from tokenmill.engine.engine import LLMEngine

    cfg = shape_config(name)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    shape = Shape.from_hf(cfg, elem=torch.tensor([], dtype=dtype).element_size())
    s = run.sizes
    kv_tokens = max(n * (p + o) for n, p, o in s.offline) + run.args.max_model_len
    tmp = tempfile.TemporaryDirectory(prefix=f"tokenmill-{name}-")
    folder = write_folder(Path(tmp.name), cfg)
    hf = None
    if not run.args.no_transformers:
        hf = run.stage(res, "build_transformers", lambda: build_hf(cfg, run.device, dtype))
    weights_gb = (shape.linear_params + shape.head_params) * shape.elem / 1e9
    from_disk = hf is not None and weights_gb < run.args.disk_load_max_gb
    engine = None

    def build_engine() -> dict:
        nonlocal engine
        config = engine_config(run, folder, shape, False, kv_tokens)
        if from_disk:
            save_s = save_safetensors(hf, folder)
            if run.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(run.device)
            before = torch.cuda.memory_allocated(run.device) if run.device.type == "cuda" else 0
            start = time.perf_counter()
            engine = LLMEngine(config)  # loads the safetensors straight to the device
            out = {"from": "safetensors", "save_s": save_s, "load_s": time.perf_counter() - start}
            if run.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(run.device) - before
                out["load_peak_gb"] = peak / 1e9  # weights + KV cache + graph pools
        else:
            loaded = build_tokenmill(folder, cfg, run.device, dtype, run.args.max_model_len, hf)
            start = time.perf_counter()
            engine = LLMEngine(config, loaded)
            out = {"from": "memory", "engine_s": time.perf_counter() - start}
        return out | {"weights_gb": weights_gb} | graph_info(engine)

    run.stage(res, "tokenmill_build", build_engine)
    if engine is not None:
        run.stage(res, "tm_warmup", tm_warmup, run, engine, shape)
        run.stage(res, "tm_decode_b1", tm_decode_b1, run, engine, shape, rates)
        if engine.runner.decode is not None:

            def eager_b1() -> dict:
                config = engine_config(run, folder, shape, True, run.args.max_model_len + 64)
                eager = LLMEngine(config, engine.loaded)
                try:
                    out = tm_decode_b1(run, eager, shape, rates)
                    run.stage(res, "profile_decode_b1_eager", profile_decode_b1, run, eager, shape)
                    return out
                finally:
                    del eager
                    free()

            run.stage(res, "tm_decode_b1_eager", eager_b1)
        run.stage(res, "tm_prefill", tm_prefill, run, engine, shape, rates)
        for n, p, o in s.offline:
            run.stage(
                res, f"tm_offline_{n}x{p}+{o}", tm_offline, run, engine, shape, rates, n, p, o
            )
        if engine.overlap:  # the largest workload once more with synchronous steps

            def offline_sync(n: int, p: int, o: int) -> dict:
                engine.overlap = False
                try:
                    return tm_offline(run, engine, shape, rates, n, p, o)
                finally:
                    engine.overlap = True

            run.stage(
                res, "tm_offline_{}x{}+{}_sync".format(*s.offline[-1]), offline_sync, *s.offline[-1]
            )
        engine = None
        free()  # the KV cache and tokenmill's weights, before transformers allocates its cache
    if hf is not None:
        run.stage(res, "hf_decode_b1", hf_decode_b1, run, hf, shape)
        for n, p, o in s.offline:
            run.stage(res, f"hf_offline_{n}x{p}+{o}", hf_offline, run, hf, shape, n, p, o)
    hf = None
    free()
    tmp.cleanup()


# -- report ---------------------------------------------------------------------------
def env_info(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    for mod in ("transformers", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # reported, not fatal
            info[mod] = f"unavailable ({type(e).__name__})"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def report(results: dict) -> str:
    rows = [["shape", "metric", "tokenmill", "transformers", "limit", "tokenmill/limit"]]
    for name, r in results["shapes"].items():
        get = _getter(r)
        rows.append([name, "decode b1 ms/token", fmt(get("tm_decode_b1", "ms_per_token")),
                     fmt(get("hf_decode_b1", "ms_per_token")), fmt(get("tm_decode_b1", "bound_ms")),
                     fmt(get("tm_decode_b1", "of_bound"), ".2f")])  # fmt: skip
        rows.append([name, "decode b1 ms/token eager", fmt(get("tm_decode_b1_eager", "ms_per_token")),
                     "", "", ""])  # fmt: skip
        rows.append([name, "prefill tokens/s", fmt(get("tm_prefill", "tokens_per_s")), "",
                     fmt(get("tm_prefill", "limit_tokens_per_s")), fmt(get("tm_prefill", "of_limit"), ".2f")])  # fmt: skip
        for stage in [k for k in r if k.startswith("tm_offline_")]:
            label = stage.removeprefix("tm_offline_")
            roof = get(stage, "roofline_seconds")
            tokens = get(stage, "tokens")
            rows.append([name, f"offline {label} out tok/s", fmt(get(stage, "out_tokens_per_s")),
                         fmt(get("hf_offline_" + label, "out_tokens_per_s")),
                         fmt(tokens / roof if roof and tokens else None), fmt(get(stage, "of_roofline"), ".2f")])  # fmt: skip
        build = r.get("tokenmill_build", {})
        rows.append([name, "graph capture s", fmt(build.get("capture_s")), "", "",
                     f"graphs={build.get('graphs')} backend={build.get('backend')}"])  # fmt: skip
        warm = r.get("tm_warmup", {})
        offline = [v.get("new_variants") for k, v in r.items()  # wholly timed stages
                   if k.startswith("tm_offline_") and isinstance(v, dict)]  # fmt: skip
        rows.append([name, "warm-up s (untimed)", fmt(warm.get("seconds")), "", "",
                     f"variants compiled: warm-up {warm.get('new_variants', '-')}, offline "
                     f"{sum(offline) if offline and None not in offline else '-'}"])  # fmt: skip
        rows.append([name, "load s", fmt(build.get("load_s")), "", "", build.get("from", "-")])
        errors = [
            k for k, v in r.items() if isinstance(v, dict) and ("error" in v or "skipped" in v)
        ]
        if errors:
            rows.append([name, "failed/skipped", ", ".join(errors), "", "", ""])
    return table(rows)


def _getter(r: dict):
    return lambda stage, key: r.get(stage, {}).get(key)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="1b,8b", help="comma-separated: 1b, 8b (default: both)")
    ap.add_argument("--quick", action="store_true", help="tiny model and sizes (a CPU smoke run)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers peer")
    ap.add_argument(
        "--time-budget", type=float, default=420.0, help="seconds; later stages are skipped"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="tokenmill dtype (auto: bf16 on CUDA)")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--async-scheduling",
        default="auto",
        choices=("auto", "on", "off"),
        help="tokenmill's asynchronous scheduling (auto: on for CUDA)",
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--disk-load-max-gb",
        type=float,
        default=4.0,
        help="load from safetensors (timed) when the weights are smaller; else in memory",
    )
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("tokenmill").setLevel(logging.INFO)  # load and graph capture times
    device = torch.device(args.device)
    sizes = QUICK if args.quick else Sizes()
    shapes = ["tiny"] if args.quick else [s.strip() for s in args.shape.split(",") if s.strip()]
    run = Run(args, device, sizes, time.perf_counter() + args.time_budget)
    results = run.results
    results |= {"env": env_info(device), "args": {k: str(v) for k, v in vars(args).items()},
                "hardware": {}, "shapes": {}}  # fmt: skip
    print(json.dumps(results["env"]), flush=True)
    hw = results["hardware"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    run.stage(hw, "copy", copy_bandwidth, device, sizes.copy_mib)
    run.stage(hw, "matmul", matmul_rate, device, sizes.matmul_n, dtype)
    rates = {"bytes_per_s": hw.get("copy", {}).get("bytes_per_s"),
             "flops_per_s": hw.get("matmul", {}).get("flops_per_s")}  # fmt: skip
    for name in shapes:
        shape_res: dict = {}
        results["shapes"][name] = shape_res
        run.stage(shape_res, "run", run_shape, run, name, rates, shape_res)
    print(report(results), flush=True)
    run.save()
    if args.out:
        print(f"results in {args.out}")


if __name__ == "__main__":
    main()
